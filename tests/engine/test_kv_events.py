"""KV events: a ZeroMQ subscriber decodes every batch with vLLM's schema (what llm-d's precise
prefix scorer and Dynamo decode) and, from the events alone, knows exactly the blocks the pool
can find: each stored once, chained to its parent, true to its tokens, removed when evicted."""

from __future__ import annotations

import msgspec
import pytest
import zmq
from redis_server import free_port
from tier_replicas import BLOCK, answer, ids
from vllm_events import AllBlocksCleared, BlockRemoved, KVEventBatch
from waiting import wait_for

import kvcache
from kvcache.blocks import ROOT_HASH, block_hash
from kvcache.engine import Engine
from kvcache.engine.kv_events import REPLAY_END, KVEventPublisher, check_endpoint, external_hash

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


class Router:
    """What a KV-aware router keeps of one replica, from its events only; it checks each one."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.connect(endpoint)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.findable: set[int] = set()
        self.digests: dict[int, bytes] = {}  # every block hash seen stored -> kvcache's digest
        self.last_sequence: int | None = None
        self.last_events: list = []
        self.batches = 0

    def receive(self, timeout_ms: int = 100) -> bool:
        """Take one batch if one comes within the timeout; False otherwise."""
        if not self.socket.poll(timeout_ms):
            return False
        topic, sequence, payload = self.socket.recv_multipart()
        number = int.from_bytes(sequence, "big")
        assert len(sequence) == 8 and (self.last_sequence is None or number == self.last_sequence + 1)
        self.last_sequence = number
        self.last_events = self.decoder.decode(payload).events
        for event in self.last_events:
            self.apply(event)
        self.batches += 1
        return True

    def apply(self, event) -> None:
        if isinstance(event, AllBlocksCleared):
            self.findable.clear()
        elif isinstance(event, BlockRemoved):
            assert set(event.block_hashes) <= self.findable, "removed a block never stored"
            self.findable -= set(event.block_hashes)
        else:
            assert event.block_size == BLOCK and event.lora_id is None and event.medium == "CPU"
            assert len(event.token_ids) == len(event.block_hashes) * BLOCK
            parent = ROOT_HASH
            if event.parent_block_hash is not None:
                assert event.parent_block_hash in self.findable, "a block stored before its parent"
                parent = self.digests[event.parent_block_hash]
            for index, external in enumerate(event.block_hashes):
                digest = block_hash(parent, event.token_ids[index * BLOCK : (index + 1) * BLOCK])
                assert external == external_hash(digest), "a hash its tokens do not chain to"
                assert external not in self.findable, "stored twice"
                self.findable.add(external)
                self.digests[external] = parent = digest

    def drain(self) -> None:
        while self.receive(20):
            pass

    def close(self) -> None:
        self.socket.close(0)
        self.context.term()


def free_endpoint() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


def subscribed(publisher: KVEventPublisher, router: Router) -> None:
    """Until the router hears the publisher (a PUB socket drops what it sends before a
    subscription arrives) and has taken every batch sent so far: AllBlocksCleared, true while the
    pool holds nothing."""
    def heard() -> bool:
        publisher.cleared()
        publisher.flush()
        return router.receive(100)

    wait_for(heard, 30)
    last = publisher.batches - 1  # (numbered from 0)

    def taken_all() -> bool:
        router.receive(50)
        return router.last_sequence == last

    wait_for(taken_all, 30)


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


def pool_findable(replica: Engine) -> set[int]:
    return {external_hash(d) for d in replica.pool.cache.allocator.block_hashes if d is not None}


def caught_up(router: Router, replica: Engine) -> bool:
    """Whether, after taking what has come, the router's view is the idle pool's."""
    router.drain()
    return router.findable == pool_findable(replica)


def test_a_router_knows_from_the_events_alone_what_the_pool_can_find(model):
    endpoint = free_endpoint()
    publisher = KVEventPublisher(endpoint)
    router = Router(endpoint)
    replica = Engine(model, num_blocks=16, block_size=BLOCK, max_running=2, token_budget=64,
                     kv_events=publisher)
    try:
        subscribed(publisher, router)
        system = ids(24, seed=1)
        first = answer(replica, system + ids(9, seed=2))
        answer(replica, system + ids(12, seed=3))  # shares the system prompt's three blocks
        wait_for(lambda: caught_up(router, replica), 30)
        assert router.findable
        held = {external_hash(d) for d in replica.pool.cache.prefix_digests(system + [0])}
        assert held <= router.findable  # a router would send the next turn here
        for seed in range(4):  # more than the pool holds: the oldest blocks are evicted
            answer(replica, ids(60, seed=10 + seed))
        wait_for(lambda: caught_up(router, replica), 30)
        assert not held <= router.findable  # evicted, and the router was told
        assert first.tokens
    finally:
        replica.close()
    wait_for(lambda: router.receive(50) and not router.findable, 30)  # AllBlocksCleared on close
    router.close()


def test_a_topic_prefixes_every_message_and_removals_in_a_row_are_one_event():
    endpoint = free_endpoint()
    publisher = KVEventPublisher(endpoint, topic="kv@pod-a@smollm2")
    router = Router(endpoint, topic="kv@pod-a@smollm2")
    other = Router(endpoint, topic="kv@pod-b")
    try:
        subscribed(publisher, router)
        assert not other.receive(200)  # another topic hears nothing
        digests = [block_hash(ROOT_HASH, list(range(i, i + BLOCK))) for i in (0, 1)]
        for digest in digests:
            publisher.removed(digest)
        publisher.flush()
        decoder, removals = msgspec.msgpack.Decoder(KVEventBatch), []

        def removal_heard() -> bool:  # (AllBlocksCleared batches of `subscribed` may come first)
            while router.socket.poll(50):
                topic, _, payload = router.socket.recv_multipart()
                assert topic == b"kv@pod-a@smollm2"
                events = decoder.decode(payload).events
                removals.extend(e for e in events if isinstance(e, BlockRemoved))
            return bool(removals)

        wait_for(removal_heard, 30)
        assert [r.block_hashes for r in removals] == [[external_hash(d) for d in digests]]  # one event
    finally:
        publisher.close()
        router.close()
        other.close()


def test_a_replica_can_connect_to_a_router_that_binds_one_socket_for_every_replica():
    endpoint = free_endpoint()
    context = zmq.Context()
    indexer = context.socket(zmq.SUB)  # the router's side binds, as llm-d's indexer does
    indexer.bind(endpoint)
    indexer.setsockopt(zmq.SUBSCRIBE, b"")
    replicas = [KVEventPublisher(endpoint, topic=f"kv@pod-{name}@m", connect=True) for name in "ab"]
    topics: set[bytes] = set()
    try:
        def heard_both() -> bool:
            for replica in replicas:
                replica.cleared()
                replica.flush()
            while indexer.poll(100):
                topics.add(indexer.recv_multipart()[0])
            return topics == {b"kv@pod-a@m", b"kv@pod-b@m"}

        wait_for(heard_both, 30)
    finally:
        for replica in replicas:
            replica.close()
        indexer.close(0)
        context.term()


@pytest.mark.parametrize("endpoint", ["127.0.0.1:5557", "tcp://127.0.0.1", "http://127.0.0.1:80", "", None])
def test_an_endpoint_that_is_not_one_is_refused_by_name(endpoint):
    with pytest.raises(ValueError, match="--kv-events must be a ZeroMQ endpoint"):
        check_endpoint(endpoint)


@pytest.mark.parametrize("port", [0, 65536, 99999])
@pytest.mark.parametrize("flag", ["--kv-events", "--kv-events-replay"])
def test_a_port_outside_1_to_65535_is_refused_by_name(port, flag):
    # (libzmq would bind 99999 as 99999 mod 65536, and 0 as any free port, while the start-up
    # line says the number given)
    with pytest.raises(ValueError, match=f"{flag}: the port must be from 1 to 65535, got {port}"):
        check_endpoint(f"tcp://127.0.0.1:{port}", flag)


@pytest.mark.parametrize("flag", ["--kv-events", "--kv-events-replay"])
def test_an_ipc_path_that_is_a_file_is_refused_by_name_and_survives(tmp_path, flag):
    # (libzmq unlinks whatever is at the path before it binds there)
    kept = tmp_path / "not-a-socket"
    kept.write_text("an operator's file")
    with pytest.raises(ValueError, match=f"{flag}: ipc://{kept} exists and is not a socket"):
        if flag == "--kv-events":
            KVEventPublisher(f"ipc://{kept}")
        else:
            KVEventPublisher(free_endpoint(), replay=f"ipc://{kept}")
    assert kept.read_text() == "an operator's file"
    (tmp_path / "folder").mkdir()
    with pytest.raises(ValueError, match="exists and is not a socket"):
        check_endpoint(f"ipc://{tmp_path / 'folder'}", flag)


def test_an_ipc_path_that_is_free_or_a_socket_is_bound(tmp_path):
    endpoint = f"ipc://{tmp_path / 'events'}"
    first = KVEventPublisher(endpoint)
    first.close()  # (its socket file may stay behind: binding there again is fine)
    assert check_endpoint(endpoint) == endpoint
    KVEventPublisher(endpoint).close()


def test_a_taken_port_is_an_error_naming_the_flag():
    endpoint = free_endpoint()
    first = KVEventPublisher(endpoint)
    try:
        with pytest.raises(OSError, match=f"--kv-events: cannot bind {endpoint}"):
            KVEventPublisher(endpoint)
    finally:
        first.close()


def _replayed(endpoint: str, request: bytes) -> list[tuple[int, bytes]]:
    """What a subscriber's replay request (the first number it missed) brings back, up to the end
    marker: [(sequence number, payload)]."""
    context = zmq.Context()
    asker = context.socket(zmq.DEALER)
    asker.connect(endpoint)
    try:
        asker.send_multipart([b"", request])  # (as a REQ socket frames it)
        got = []
        while asker.poll(10_000):
            delimiter, number, payload = asker.recv_multipart()
            assert delimiter == b""
            if number == REPLAY_END:
                assert payload == b""
                return got
            got.append((int.from_bytes(number, "big"), payload))
        raise AssertionError("no end marker within 10 s")
    finally:
        asker.close(0)
        context.term()


def test_a_subscriber_that_missed_batches_gets_them_replayed_from_the_number_it_asks_for():
    """vLLM's replay endpoint: the kept batches from the number asked for, in order, each decoding
    with vLLM's schema, then the end marker; only the last `replay_batches` are kept; a request
    that is not a number gets the end marker alone."""
    replay = free_endpoint()
    publisher = KVEventPublisher(free_endpoint(), replay=replay, replay_batches=4)
    try:
        for index in range(6):  # with the AllBlocksCleared batch of the start: 7 batches, 0 .. 6
            publisher.removed(block_hash(ROOT_HASH, [index] * BLOCK))
            publisher.flush()
        wait_for(lambda: [n for n, _ in _replayed(replay, (0).to_bytes(8, "big"))] == [3, 4, 5, 6], 30)
        got = _replayed(replay, (5).to_bytes(8, "big"))
        assert [number for number, _ in got] == [5, 6]
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        removed = [decoder.decode(payload).events[0] for _, payload in got]
        assert [event.block_hashes for event in removed] == [
            [external_hash(block_hash(ROOT_HASH, [index] * BLOCK))] for index in (4, 5)]
        assert _replayed(replay, b"\x01\x02\x03") == []  # not 8 bytes: the end marker alone
        assert _replayed(replay, (99).to_bytes(8, "big")) == []
    finally:
        publisher.close()


def test_a_replay_endpoint_that_is_not_one_or_is_taken_is_refused_by_name():
    with pytest.raises(ValueError, match="--kv-events-replay must be a ZeroMQ endpoint"):
        KVEventPublisher(free_endpoint(), replay="127.0.0.1:5558")
    taken = free_endpoint()
    first = KVEventPublisher(free_endpoint(), replay=taken)
    try:
        with pytest.raises(OSError, match=f"--kv-events-replay: cannot bind {taken}"):
            KVEventPublisher(free_endpoint(), replay=taken)
    finally:
        first.close()


def test_requests_in_a_row_each_get_their_whole_answer_and_publishing_goes_on():
    """One subscriber asking again and again: every answer complete (the end marker last), and a
    batch flushed after them is still published (and kept)."""
    replay = free_endpoint()
    publisher = KVEventPublisher(free_endpoint(), replay=replay, replay_batches=50)
    try:
        for index in range(20):  # batches 1 .. 20 (0: AllBlocksCleared of the start)
            publisher.removed(block_hash(ROOT_HASH, [index] * BLOCK))
            publisher.flush()
        wait_for(lambda: len(_replayed(replay, (0).to_bytes(8, "big"))) == 21, 30)
        answers = [_replayed(replay, (10).to_bytes(8, "big")) for _ in range(5)]
        assert all([number for number, _ in answer] == list(range(10, 21)) for answer in answers)
        publisher.cleared()
        publisher.flush()
        wait_for(lambda: [n for n, _ in _replayed(replay, (21).to_bytes(8, "big"))] == [21], 30)
    finally:
        publisher.close()
