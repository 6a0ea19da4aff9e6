"""Agent sessions' advisory KV hints (kvcache.engine.sessions): a pinned turn's blocks outlive
memory pressure until the pin expires (a clock the test moves, never a sleep); a demoted turn's
blocks are the first the pool lets go and come back from the disk tier on resume; hints never
change an answer and a request without them is untouched; a bad hint is refused naming its field."""

from __future__ import annotations

import pytest
from tier_replicas import BLOCK, NEW, ids

import kvcache
from kvcache.blocks import BlockAllocator
from kvcache.engine import Engine
from kvcache.engine.sessions import KVHints, read_kv_hints
from kvcache.generation.params import RequestError
from kvcache.tiers.disk_store import DiskBlockStore


# ---- reading hints (no model) -----------------------------------------------------------------
def test_hints_are_read_from_the_body_or_the_session_header():
    assert read_kv_hints(None) is None  # no hint: nothing
    assert read_kv_hints(None, "agent-7") == KVHints("agent-7")
    read = read_kv_hints({"session_id": "agent-7", "pin": {"ttl_s": 30}, "prefetch": True}, "agent-7")
    assert read == KVHints("agent-7", pin_ttl_s=30.0, prefetch=True)
    assert read_kv_hints({"session_id": "a", "retain": {"priority": 5}}).keeps
    assert read_kv_hints({"session_id": "a", "demote": {"destination": "redis"}}).demote == "redis"


@pytest.mark.parametrize("hints, header, field", [
    ([], None, "kv_hints must be an object"),
    ({"session_id": "a", "keep": True}, None, "kv_hints.keep is not a hint"),
    ({"pin": {"ttl_s": 5}}, None, "kv_hints needs a session"),
    ({"session_id": ""}, None, "kv_hints.session_id"),
    ({"session_id": "a b"}, None, "kv_hints.session_id"),
    ({"session_id": 7}, None, "kv_hints.session_id"),
    ({}, "x" * 129, "x-session-id"),
    ({"session_id": "a"}, "b", "name different sessions"),
    ({"session_id": "a", "pin": 30}, None, "kv_hints.pin must be an object"),
    ({"session_id": "a", "pin": {"ttl": 30}}, None, "kv_hints.pin must be an object"),
    ({"session_id": "a", "pin": {"ttl_s": 0}}, None, "kv_hints.pin.ttl_s"),
    ({"session_id": "a", "pin": {"ttl_s": -1}}, None, "kv_hints.pin.ttl_s"),
    ({"session_id": "a", "pin": {"ttl_s": 1e9}}, None, "kv_hints.pin.ttl_s"),
    ({"session_id": "a", "pin": {"ttl_s": True}}, None, "kv_hints.pin.ttl_s"),
    ({"session_id": "a", "retain": {"priority": 1.5}}, None, "kv_hints.retain.priority"),
    ({"session_id": "a", "retain": {"priority": 101}}, None, "kv_hints.retain.priority"),
    ({"session_id": "a", "demote": {"destination": "tape"}}, None, "kv_hints.demote.destination"),
    ({"session_id": "a", "demote": {"destination": "disk"}, "pin": {"ttl_s": 5}}, None, "kv_hints.demote"),
    ({"session_id": "a", "release": True, "retain": {"priority": 2}}, None, "kv_hints.release"),
    ({"session_id": "a", "prefetch": "yes"}, None, "kv_hints.prefetch"),
    ({"session_id": "a", "release": 1}, None, "kv_hints.release"),
])
def test_a_bad_hint_is_refused_naming_its_field(hints, header, field):
    with pytest.raises(RequestError, match=field.replace(".", r"\.")):
        read_kv_hints(hints, header)


# ---- the pool's eviction classes (no model) ---------------------------------------------------
def cached_chain(allocator: BlockAllocator, seq: str, tokens: list[int]) -> list[bytes]:
    """A sequence of `tokens` written and freed: its whole blocks cached; their digests."""
    allocator.add_sequence(seq)
    allocator.reserve([seq], [len(tokens)])
    allocator.declare_tokens(seq, tokens)
    allocator.commit(seq, len(tokens))
    digests = list(allocator.sequence(seq).hashes)
    allocator.free_sequence(seq)
    return digests


def test_an_unpinned_block_is_evicted_again_and_a_demoted_one_first():
    allocator = BlockAllocator(num_blocks=6, block_size=2)
    first = cached_chain(allocator, "a", [1, 2, 3, 4])
    second = cached_chain(allocator, "b", [5, 6, 7, 8])
    allocator.pin(first)
    allocator.pin(first)  # (two pins: one unpin leaves it pinned)
    allocator.unpin(first)
    allocator.add_sequence("c")
    allocator.reserve(["c"], [8])  # 2 free blocks, then 2 evicted: the unpinned ones first
    assert allocator.attachable(first) == 2 and allocator.attachable(second) == 0
    allocator.unpin(first)
    allocator.free_sequence("c")
    third = cached_chain(allocator, "d", [9, 10, 11, 12])
    allocator.demote(third)  # the newest freed, evicted before anything older
    allocator.add_sequence("e")
    allocator.reserve(["e"], [8])  # 2 free, then 2 evicted: the demoted ones, not the older ones
    assert allocator.attachable(third) == 0 and allocator.attachable(first) == 2


# ---- on the tiny bundled model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


def engine(model, store=None) -> Engine:
    return Engine(model, num_blocks=16, block_size=BLOCK, max_running=1, token_budget=64, kv_store=store)


def turn(replica: Engine, prompt: list[int], hints: KVHints | None = None) -> list[int]:
    handle = replica.submit(prompt, max_tokens=NEW, temperature=0.0, ignore_eos=True, hints=hints)
    while not handle.done:
        replica.step()
    return handle.result().tokens


def held(replica: Engine, tokens: list[int]) -> int:
    """The whole blocks of `tokens` the pool can attach."""
    allocator = replica.pool.cache.allocator
    return allocator.attachable(replica.pool.cache.prefix_digests(tokens))


def pressure(replica: Engine, seeds=(50, 51)) -> None:
    """Other prompts, more than the pool's free blocks: unused blocks are evicted."""
    for seed in seeds:
        turn(replica, ids(60, seed=seed))


@pytest.mark.kernels
def test_a_pinned_turn_outlives_pressure_until_its_pin_expires(model):
    now = [0.0]
    replica = engine(model)
    replica.sessions.clock = lambda: now[0]
    prompt = ids(40, seed=1)
    history = prompt + turn(replica, prompt, KVHints("agent", pin_ttl_s=60))
    blocks = (len(history) - 1) // BLOCK
    pressure(replica)
    assert held(replica, history) == blocks  # pinned: the other prompts' blocks went instead
    now[0] = 61.0
    replica.step()  # (idle: the step's end expires what is due)
    pressure(replica, seeds=(52, 53))
    assert held(replica, history) < blocks  # the pin expired: evicted as any block
    unhinted = engine(model)
    history = prompt + turn(unhinted, prompt)
    pressure(unhinted)
    assert held(unhinted, history) < blocks  # without the hint the same pressure evicts it


@pytest.mark.kernels
def test_a_demoted_turn_goes_first_and_a_resume_loads_it_back_from_disk(model, tmp_path):
    replica = engine(model, DiskBlockStore(tmp_path / "kv"))
    prompt = ids(40, seed=2)
    turn(replica, ids(24, seed=3))  # an older turn, freed before the session's
    history = prompt + turn(replica, prompt, KVHints("agent", demote="disk"))
    assert replica.store_tier.store.flush()
    turn(replica, ids(60, seed=4))  # needs some evictions: the demoted blocks go first
    assert held(replica, history) == 0 and held(replica, ids(24, seed=3)) > 0
    found = replica.store_tier.store.counters.hit_blocks
    resume = history + ids(8, seed=5)
    turn(replica, resume, KVHints("agent"))
    assert replica.store_tier.store.counters.hit_blocks > found  # read back from the disk tier


@pytest.mark.kernels
def test_a_demotion_to_a_tier_the_engine_lacks_is_refused_naming_the_field(model):
    with pytest.raises(RequestError, match=r"kv_hints\.demote\.destination 'disk'"):
        engine(model).submit(ids(10, seed=1), max_tokens=1, hints=KVHints("agent", demote="disk"))


@pytest.mark.kernels
def test_hints_never_change_an_answer_and_no_hint_changes_nothing(model, tmp_path):
    """A session of five turns with every hint, under pressure, against the same turns without
    hints and against a cold engine each turn: the same tokens; without hints no session is kept."""
    hinted = engine(model, DiskBlockStore(tmp_path / "a"))
    plain = engine(model, DiskBlockStore(tmp_path / "b"))
    hints = [KVHints("s", pin_ttl_s=30), KVHints("s", retain_priority=3), KVHints("s", demote="disk"),
             KVHints("s", prefetch=True), KVHints("s", release=True)]
    history: list[int] = []
    for index, hint in enumerate(hints):
        prompt = history + ids(12, seed=100 + index)
        answers = [turn(hinted, prompt, hint), turn(plain, prompt), turn(engine(model), prompt)]
        assert answers[0] == answers[1] == answers[2], index
        history = prompt + answers[0]
        pressure(hinted, seeds=(60 + index,))
        pressure(plain, seeds=(60 + index,))
    assert not hinted.sessions.live  # released with the last turn
    assert not plain.sessions.live
