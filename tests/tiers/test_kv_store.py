"""Replicas share prefix blocks through a real Redis (tests/redis_server.py): a conversation moved
to another replica is served from the blocks the first one wrote and answers as a cold replica
would; the store going away, coming back empty, holding tampered bytes or another model's blocks
changes no answer."""

from __future__ import annotations

import random
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_server import RedisServer
from tier_replicas import BLOCK, NEW, answer, engine, flushed, ids
from tiny_models import tiny_model
from waiting import wait_for

import kvcache
from kvcache.engine import Engine
from kvcache.generation.params import RequestError
from kvcache.tiers.block_codec import block_key
from kvcache.tiers.redis_store import RedisBlockStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

@pytest.fixture(scope="module")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


def written_blocks(first: list[int], reply: list[int]) -> int:
    """Tokens of the full blocks a replica holds after answering: the prompt and the reply but
    its last token (never run through the model)."""
    return (len(first) + len(reply) - 1) // BLOCK * BLOCK


def test_the_second_turn_on_another_replica_is_served_from_the_first_replicas_blocks(model, redis_server):
    redis_server.client().flushdb()
    first_replica, second_replica = engine(model, redis_server.url), engine(model, redis_server.url)
    cold = engine(model)
    first = ids(45, seed=1)
    reply = answer(first_replica, first).tokens
    flushed(first_replica)
    second = first + reply + ids(10, seed=2)
    warm = answer(second_replica, second)
    assert warm.tokens == answer(cold, second).tokens  # exactly as a cold replica answers
    shared = written_blocks(first, reply)
    assert warm.usage.cached_tokens == shared
    assert second_replica.metrics.prefill_tokens == len(second) - shared  # only the new tokens ran
    counters = second_replica.stats()["kv_store"]
    assert counters["hit_blocks"] == shared // BLOCK and counters["read_round_trips"] == 2
    assert counters["invalid_blocks"] == 0 and counters["errors"] == 0
    first_replica.close(), second_replica.close()


STEP_SECONDS, TOKEN_SECONDS = 1.0, 0.01  # the priced replicas' forwards: a step's fixed cost, a row token's


def priced(replica: Engine) -> Engine:
    """`replica` on a clock that moves only by its forwards, each costing STEP_SECONDS plus
    TOKEN_SECONDS a token: every figure of its metrics known in advance."""
    clock = [0.0]
    forward = replica.runner.run

    def timed(work):
        clock[0] += STEP_SECONDS + TOKEN_SECONDS * sum(map(len, work.batch.tokens))
        return forward(work)

    replica.clock = lambda: clock[0]
    replica.runner.run = timed
    return replica


def test_prefill_seconds_saved_prices_each_loaded_token_once_at_what_a_prompt_token_costs(
        model, redis_server):
    """A replica whose first request is a store hit: its 40 loaded tokens are priced at what one
    more prompt token adds to a step (TOKEN_SECONDS here), not at the mean of the short prefill
    left after the hit, which is mostly a step's fixed cost; so the hit saves what the skipped
    tokens cost, at most the prompt's own cold prefill."""
    redis_server.client().flushdb()
    first, second = priced(engine(model, redis_server.url)), priced(engine(model, redis_server.url))
    prompt = ids(45, seed=11)
    answer(first, prompt)
    flushed(first)
    cold_seconds = first.metrics.prefill_seconds
    assert cold_seconds == pytest.approx(STEP_SECONDS + 45 * TOKEN_SECONDS)  # one step of 45 tokens
    assert first.metrics.prefill_seconds_saved == 0
    loaded = answer(second, prompt).usage.cached_tokens
    assert loaded == 40 and second.metrics.prefill_tokens == 5  # 5 blocks read, the rest computed
    assert second.metrics.prefill_token_seconds == pytest.approx(TOKEN_SECONDS)
    assert second.metrics.prefill_seconds_saved == pytest.approx(loaded * TOKEN_SECONDS)
    assert first.metrics.prefill_seconds_saved + second.metrics.prefill_seconds_saved <= cold_seconds
    assert second.metrics.unpriced_tokens == 0


def test_requests_succeed_while_the_store_is_down_and_sharing_resumes_after_it_restarts(model):
    redis_server = RedisServer().start()
    stores = [RedisBlockStore(redis_server.url, timeout_s=5.0, retry_s=0.3) for _ in range(2)]
    first_replica, second_replica, cold = engine(model, stores[0]), engine(model, stores[1]), engine(model)
    try:
        redis_server.stop()
        prompt = ids(30, seed=3)
        assert answer(first_replica, prompt).tokens == answer(cold, prompt).tokens
        assert answer(second_replica, prompt).tokens == answer(cold, prompt).tokens
        counters = stores[0].counters
        assert counters.errors >= 1 and not counters.up and counters.outages == 1
        redis_server.start()  # back, and empty
        assert wait_for(stores[0].available)  # past the retry pause
        reply = answer(first_replica, prompt).tokens
        flushed(first_replica)
        assert counters.up and counters.written_blocks > 0
        follow_up = prompt + reply + ids(5, seed=4)
        warm = answer(second_replica, follow_up)
        assert warm.tokens == answer(cold, follow_up).tokens
        # the second replica's own pool holds them too (it answered the prompt while the store
        # was down): every token it wrote, its partial last block included
        assert warm.usage.cached_tokens == len(prompt) + len(reply) - 1
    finally:
        first_replica.close(), second_replica.close()
        redis_server.stop()


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another block's bytes"])
def test_a_tampered_block_is_refused_and_the_answer_does_not_change(model, redis_server, damage):
    client = redis_server.client()
    client.flushdb()
    first_replica, second_replica = engine(model, redis_server.url), engine(model, redis_server.url)
    cold = engine(model)
    prompt = ids(40, seed=5)
    answer(first_replica, prompt)
    flushed(first_replica)
    digests = first_replica.pool.cache.prefix_digests(prompt)
    space = first_replica.store_tier.space
    target = block_key(space, digests[2])  # the third block: the first two are still good
    value = bytearray(client.get(target))
    if damage == "flip a byte":
        value[len(value) // 2] ^= 0x40
    elif damage == "truncate":
        value = value[:-3]
    else:
        value = bytearray(client.get(block_key(space, digests[0])))
    client.set(target, bytes(value))
    warm = answer(second_replica, prompt)
    assert warm.tokens == answer(cold, prompt).tokens
    assert warm.usage.cached_tokens == 2 * BLOCK  # the run stops at the refused block
    assert second_replica.stats()["kv_store"]["invalid_blocks"] == 1
    first_replica.close(), second_replica.close()


def test_a_block_of_another_models_fingerprint_is_never_read(redis_server):
    client = redis_server.client()
    client.flushdb()
    writer, reader = tiny_model(seed=0), tiny_model(seed=1)  # the same shapes, other weights
    first_replica, other = engine(writer, redis_server.url), engine(reader, redis_server.url)
    prompt = [random.Random(6).randrange(64) for _ in range(33)]
    answer(first_replica, prompt)
    flushed(first_replica)
    assert first_replica.store_tier.space != other.store_tier.space
    stored = {key.decode().split(":")[1] for key in client.scan_iter("kvcache:*")}
    assert stored == {first_replica.store_tier.space}
    got = answer(other, prompt)
    assert got.usage.cached_tokens == 0 and other.stats()["kv_store"]["hit_blocks"] == 0
    assert got.tokens == answer(engine(reader), prompt).tokens
    first_replica.close(), other.close()


def test_a_store_url_that_is_not_redis_is_refused_by_name():
    with pytest.raises(RequestError, match="redis://HOST:PORT/DB"):
        engine(tiny_model(), "http://127.0.0.1:1")


class TricklingServer:
    """A TCP server on loopback that answers every connection with one byte at a time, each well
    within a socket timeout, forever: a socket read never times out; only a bound on the whole
    call ends it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self.sock.getsockname()[1]}/0"
        self.stopping = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            try:
                connection, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(connection,), daemon=True).start()

    def _trickle(self, connection) -> None:
        with connection:
            try:
                connection.recv(1 << 16)
                connection.sendall(b":")
                while not self.stopping.wait(0.05):
                    connection.sendall(b"1")  # an integer reply that never ends
            except OSError:
                return

    def stop(self) -> None:
        self.stopping.set()
        self.sock.close()


def test_a_store_that_trickles_its_answers_is_skipped_and_the_answer_does_not_change(model):
    trickling = TricklingServer()
    store = RedisBlockStore(trickling.url, timeout_s=0.5, retry_s=3600)
    replica, cold = engine(model, store), engine(model)
    try:
        prompt = ids(30, seed=7)
        assert answer(replica, prompt).tokens == answer(cold, prompt).tokens
        assert store.counters.errors == 1 and not store.counters.up and store.counters.hit_blocks == 0
        assert answer(replica, ids(30, seed=8)).tokens == answer(cold, ids(30, seed=8)).tokens  # not asked
        assert store.counters.errors == 1
    finally:
        replica.close()
        trickling.stop()


def test_a_store_read_on_its_way_never_holds_up_the_steps_of_running_rows(model):
    """A request whose blocks are being read from a store that never finishes answering waits
    in the queue; the running rows' steps go on without waiting for that read."""
    trickling = TricklingServer()
    store = RedisBlockStore(trickling.url, timeout_s=60, retry_s=3600)
    replica, cold = engine(model, store), engine(model)
    try:
        short = ids(5, seed=3)  # no full block: nothing to read, admitted at once
        waiting = replica.submit(ids(30, seed=4), max_tokens=NEW, temperature=0.0)
        running = replica.submit(short, max_tokens=NEW, temperature=0.0, ignore_eos=True)
        done = running.result(timeout=120)  # steps driven here, the read still on its way
        assert done.tokens == answer_for(cold, short, NEW)
        assert replica.store_tier.reads_on_their_way() == 1 and not waiting.done
        assert store.counters.errors == 0  # no step waited out the read's time
        waiting.cancel()
        replica.step()
        assert waiting.result().finish_reason == "cancelled"
    finally:
        replica.close()
        trickling.stop()


def test_blocks_found_missing_are_written_again_after_the_store_was_flushed(model, redis_server):
    client = redis_server.client()
    client.flushdb()
    replica = Engine(model, num_blocks=8, block_size=BLOCK, max_running=1, token_budget=64,
                     kv_store=redis_server.url)  # a pool of 8 blocks: the next prompt evicts this one's
    try:
        prompt = ids(40, seed=9)
        first = answer(replica, prompt).tokens
        flushed(replica)
        keys = [block_key(replica.store_tier.space, d) for d in replica.pool.cache.prefix_digests(prompt)]
        assert len(keys) == 4 and client.exists(*keys) == 4  # the prompt's full blocks but its last
        client.flushall()
        answer(replica, ids(56, seed=10))  # its 8 blocks evict the first prompt's from the pool
        assert answer(replica, prompt).tokens == first  # asks the store, finds nothing, recomputes
        flushed(replica)
        assert client.exists(*keys) == 4  # noticed missing on that read: written again
    finally:
        replica.close()


def test_a_store_hit_never_takes_blocks_the_plan_gave_to_decoding_rows(model, redis_server):
    """Two rows decode in a tight pool; at the step they each need a new block, a prompt whose
    five blocks are all in the store is admitted with room for three. Its store hit loads only the
    chunk the plan gave it, so the decoding rows get their blocks: every answer is the cold one
    (no row fails for lack of a block), and the later chunks come from the store too."""
    redis_server.client().flushdb()
    writer = engine(model, redis_server.url)
    prompt = ids(41, seed=8)  # five full blocks of 8, and one token
    answer(writer, prompt)
    flushed(writer)
    tight = Engine(model, num_blocks=9, block_size=BLOCK, max_running=4, token_budget=64,
                   prefill_slowdown=None, kv_store=redis_server.url)  # (blocks, not time, bound it)
    decoders = [tight.submit(ids(15, seed=9 + index), max_tokens=12, ignore_eos=True) for index in range(2)]
    read = lambda: tight.store_tier.reads_on_their_way() == 0  # noqa: E731 (the store answered)
    wait_for(read, timeout=30)  # (a request waits for its store read: none is admitted before)
    tight.step()  # both prompts prefilled: 2 blocks each, their first token chosen
    tight.step()  # their 16th position: still 2 blocks each, 5 free
    late = tight.submit(prompt, max_tokens=NEW, ignore_eos=True)
    wait_for(read, timeout=30)  # its blocks read, off the step
    tight.step()  # the decoders' 17th positions need a block each; the prompt gets the other 3
    counters = tight.stats()["kv_store"]
    assert counters["hit_blocks"] == 3  # the chunk the plan gave it, not the 5 the store holds
    assert all(request.finish is None for request in tight.running)
    cold = engine(model)
    for index, handle in enumerate(decoders):
        done = handle.result()
        assert done.finish_reason == "length" and done.tokens == answer_for(cold, ids(15, seed=9 + index), 12)
    done = late.result()
    assert done.finish_reason == "length" and done.tokens == answer(cold, prompt).tokens
    assert tight.stats()["kv_store"]["hit_blocks"] >= 5  # the rest came from the store too
    writer.close(), tight.close()


def answer_for(replica: Engine, prompt: list[int], max_tokens: int) -> list[int]:
    return replica.generate([prompt], max_tokens=max_tokens, temperature=0.0, ignore_eos=True)[0].tokens


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), blocks=st.sampled_from([10, 14, 24]), budget=st.sampled_from([16, 64]))
def test_store_hits_in_a_tight_pool_change_no_answer(model, redis_server, seed, blocks, budget):
    """Prompts some of which another replica wrote to the store (sharing prefixes), arriving at
    random steps into a tight pool (preemptions) with chunked prefill: every answer is the cold
    one, none fails, and every block comes back."""
    redis_server.client().flushdb()
    rng = random.Random(seed)
    shared = ids(rng.randrange(0, 20), seed)
    prompts = [shared + ids(rng.randrange(1, 20), seed + 1 + index) for index in range(5)]
    writer = engine(model, redis_server.url)
    for prompt in prompts[::2]:
        answer(writer, prompt)
    flushed(writer)
    tight = Engine(model, num_blocks=blocks, block_size=BLOCK, max_running=3, token_budget=budget,
                   kv_store=redis_server.url)
    arrivals = sorted((rng.randrange(0, 6), index) for index in range(len(prompts)))
    handles, step = {}, 0
    while len(handles) < len(prompts) or not all(h.done for h in handles.values()):
        for arrive, index in arrivals:
            if arrive == step and index not in handles:
                handles[index] = tight.submit(prompts[index], max_tokens=NEW, ignore_eos=True)
        tight.step()
        step += 1
        assert step < 2000
    cold = engine(model)
    for index, prompt in enumerate(prompts):
        done = handles[index].result()
        assert done.finish_reason == "length", done.error
        assert done.tokens == answer(cold, prompt).tokens
    assert tight.stats()["kv_store"]["invalid_blocks"] == 0
    tight.pool.cache.allocator.check_invariants()
    assert not tight.running and tight.pool.cache.allocator.num_in_use == 0
    writer.close(), tight.close()
