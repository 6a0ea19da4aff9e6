"""KV events carry the tier: a block's life through the pool ("CPU"), the disk tier ("DISK") and
Redis ("REDIS") reaches a subscriber, decoded with vLLM's own event types, as BlockStored and
BlockRemoved in each medium: stored in the pool, written below it (demoted), evicted from the
pool, loaded back (promoted), in that order; a read from Redis that promotes a block into a
replica's disk tier is published too."""

from __future__ import annotations

from collections import defaultdict

import msgspec
import pytest
import zmq
from redis_server import RedisServer, free_port
from tier_replicas import BLOCK, answer, ids
from vllm_events import AllBlocksCleared, BlockStored, KVEventBatch
from waiting import wait_for

import kvcache
from kvcache.blocks import ROOT_HASH, block_hash
from kvcache.engine import Engine
from kvcache.engine.kv_events import KVEventPublisher, external_hash
from kvcache.tiers.disk_store import DiskBlockStore
from kvcache.tiers.redis_store import RedisBlockStore
from kvcache.tiers.tiered_store import TieredStore

pytestmark = [pytest.mark.kernels, pytest.mark.processes]


class Subscriber:
    """Every event of one replica, in order, by block hash: [(kind, medium), ...]."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.connect(publisher.endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.history: dict[int, list[tuple[str, str]]] = defaultdict(list)
        self.stored: dict[tuple[int, str], BlockStored] = {}

        def heard() -> bool:  # (a PUB socket drops what it sends before the subscription arrives)
            publisher.cleared()
            publisher.flush()
            return self.drain()

        wait_for(heard, 30)

    def drain(self) -> bool:
        taken = False
        while self.socket.poll(50):
            for event in self.decoder.decode(self.socket.recv_multipart()[2]).events:
                if isinstance(event, AllBlocksCleared):
                    continue
                kind = "stored" if isinstance(event, BlockStored) else "removed"
                for external in event.block_hashes:
                    self.history[external].append((kind, event.medium))
                    if kind == "stored":
                        self.stored[external, event.medium] = event
            taken = True
        return taken

    def drained(self) -> bool:
        """Take what has come (True, for a condition to follow)."""
        self.drain()
        return True

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


def replica(model, store) -> tuple[Engine, Subscriber]:
    publisher = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    events = Subscriber(publisher)  # (subscribed first: what the engine's start publishes is heard)
    engine = Engine(model, num_blocks=16, block_size=BLOCK, max_running=2, token_budget=64, kv_store=store,
                    kv_events=publisher)
    return engine, events


def first_block(prompt: list[int]) -> int:
    return external_hash(block_hash(ROOT_HASH, prompt[:BLOCK]))


def stored_evicted_and_loaded_back(model, store, medium: str) -> None:
    """A block stored in the pool, written to `store`, evicted from the pool by other prompts and
    loaded back from `store`: its events, in order, name each medium."""
    engine, events = replica(model, store)
    prompt = ids(40, seed=1)
    try:
        first = answer(engine, prompt)
        assert engine.store_tier.store.flush()
        for seed in range(4):  # more than the pool's 16 blocks: the prompt's are evicted
            answer(engine, ids(60, seed=10 + seed))
        assert engine.store_tier.store.flush()
        hits = engine.store_tier.store.counters.hit_blocks
        again = answer(engine, prompt)
        assert engine.store_tier.store.counters.hit_blocks > hits  # loaded back from the tier
        assert again.tokens == first.tokens
        block = first_block(prompt)
        expected = [("stored", "CPU"), ("stored", medium), ("removed", "CPU"), ("stored", "CPU")]
        wait_for(lambda: events.drained() and events.history[block] == expected, 30)
        assert events.history[block] == expected
        written = events.stored[block, medium]  # this replica wrote it: its lineage and tokens
        assert written.parent_block_hash is None and written.token_ids == prompt[:BLOCK]
        assert written.block_size == BLOCK
    finally:
        engine.close()
        events.close()


def test_a_block_demoted_to_disk_and_loaded_back_is_published_in_each_medium(model, tmp_path):
    stored_evicted_and_loaded_back(model, DiskBlockStore(tmp_path / "kv"), "DISK")


def test_a_block_demoted_to_redis_and_loaded_back_is_published_in_each_medium(model, redis_server):
    redis_server.client().flushdb()
    stored_evicted_and_loaded_back(model, RedisBlockStore(redis_server.url), "REDIS")


def test_a_disk_tier_eviction_is_a_removal_in_the_disk_medium(model, tmp_path):
    store = DiskBlockStore(tmp_path / "kv", max_bytes=1 << 16)  # a handful of the tiny model's blocks
    engine, events = replica(model, store)
    try:
        prompt = ids(40, seed=1)
        answer(engine, prompt)
        assert store.flush()
        for seed in range(3):
            answer(engine, ids(60, seed=20 + seed))
        assert store.flush()
        block = first_block(prompt)
        wait_for(lambda: events.drained() and ("removed", "DISK") in events.history[block], 30)
        history = events.history[block]
        assert ("removed", "DISK") in history
        assert history.index(("stored", "DISK")) < history.index(("removed", "DISK"))
    finally:
        engine.close()
        events.close()


def test_a_block_read_from_redis_is_promoted_into_the_disk_tier_and_the_pool(model, redis_server, tmp_path):
    redis_server.client().flushdb()
    prompt = ids(40, seed=3)
    writer = Engine(model, num_blocks=64, block_size=BLOCK, max_running=2, token_budget=64,
                    kv_store=RedisBlockStore(redis_server.url))
    try:
        first = answer(writer, prompt)
        assert writer.store_tier.store.flush()
    finally:
        writer.close()
    tiers = TieredStore([DiskBlockStore(tmp_path / "kv"), RedisBlockStore(redis_server.url)])
    engine, events = replica(model, tiers)
    try:
        assert answer(engine, prompt).tokens == first.tokens
        assert tiers.flush()
        block = first_block(prompt)
        want = {("stored", "DISK"), ("stored", "CPU")}
        wait_for(lambda: events.drained() and want <= set(events.history[block]), 30)
        assert want <= set(events.history[block])
        assert ("stored", "REDIS") not in events.history[block]  # read from Redis, not written there
        promoted = events.stored[block, "DISK"]  # not computed here: no lineage, no tokens
        assert promoted.parent_block_hash is None and promoted.token_ids == []
    finally:
        engine.close()
        events.close()


def test_a_replica_restarted_on_a_disk_folder_publishes_the_blocks_already_there(model, tmp_path):
    prompt = ids(40, seed=4)
    first = Engine(model, num_blocks=64, block_size=BLOCK, max_running=2, token_budget=64,
                   kv_store=DiskBlockStore(tmp_path / "kv"))
    try:
        answer(first, prompt)
        assert first.store_tier.store.flush()
    finally:
        first.close()
    engine, events = replica(model, DiskBlockStore(tmp_path / "kv"))
    try:
        block = first_block(prompt)
        wait_for(lambda: events.drained() and ("stored", "DISK") in events.history[block], 30)
        assert events.history[block] == [("stored", "DISK")]  # before any request: on disk only
        held = events.stored[block, "DISK"]
        assert held.parent_block_hash is None and held.token_ids == []
    finally:
        engine.close()
        events.close()
