"""The scheduler's block accounting against the pool it plans for, without a model: random
conversations (each turn continuing the last one's tokens, so prefixes attach whole blocks and
parts of blocks) run through snapshot -> schedule -> attach -> reserve -> commit as the engine's
`KVPool` does, on a PagedCache with or without a sliding-window group sized as the engine sizes
it. Every plan must fit `reserve`, and a request alone in the queue must always be admitted."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import PagedCache
from kvcache.engine.scheduler import Limits, RunningSeq, WaitingSeq, blocks_for, schedule
from kvcache.memory import window_blocks_per_sequence


def _cache(rng: random.Random, size: int, blocks: int, limits: Limits, windowed: bool) -> PagedCache:
    if not windowed:
        return PagedCache(blocks, size, num_layers=1)
    window = rng.randint(1, 12)
    config = dict(num_hidden_layers=2, num_key_value_heads=1, head_dim=2, sliding_window=window,
                  layer_types=["full_attention", "sliding_attention"])
    per_row = window_blocks_per_sequence(window, size, limits.token_budget)
    return PagedCache(blocks, size, window_blocks=limits.max_running * per_row, config=config)


def _plan(cache: PagedCache, running: list[dict], waiting: list[dict], limits: Limits):
    full = cache.full_allocator
    seqs = [RunningSeq(r["id"], r["id"], len(r["tokens"]), r["cached"], len(full.sequence(s).table),
                       full.unshared_blocks(s)) for r, s in zip(running, cache.rows)]
    queue = [WaitingSeq(r["id"], r["id"], len(r["tokens"]), *cache.prefix_cost(r["tokens"]))
             for r in waiting[: limits.max_running]]
    return schedule(seqs, queue, full.num_allocatable, limits)


def _step(cache: PagedCache, running: list[dict], waiting: list[dict], limits: Limits, rng) -> list[dict]:
    """One step; returns the requests that finished (their rows freed)."""
    plan = _plan(cache, running, waiting, limits)
    if plan.preempt:
        keep = [row for row, r in enumerate(running) if r["id"] not in plan.preempt]
        victims = [r for r in running if r["id"] in plan.preempt]
        cache.select(keep)
        running[:] = [running[row] for row in keep]
        for victim in victims:
            victim["cached"] = 0
        waiting[:0] = sorted(victims, key=lambda r: r["id"])
    for request in [r for r in waiting if r["id"] in plan.admit]:
        waiting.remove(request)
        request["cached"] = cache.add_sequence(request["tokens"])
        running.append(request)
    assert plan.tokens or running or not waiting, "a request alone in the queue was not admitted"
    rows = {r["id"]: row for row, r in enumerate(running)}
    work = [(rows[i], 1) for i in plan.decode] + [(rows[i], count) for i, count in plan.prefill]
    batch = [row for row, _ in work]
    ends = [running[row]["cached"] + count for row, count in work]
    cache.reserve(batch, ends)  # OutOfBlocksError here: the plan does not fit the pool
    cache.commit(batch, ends)
    for row, end in zip(batch, ends):
        request = running[row]
        request["cached"] = end
        if end == len(request["tokens"]):  # sampled: its next token, declared
            request["tokens"].append(rng.randrange(3))
            cache.declare_tokens(row, request["tokens"][-1:])
    done = [r for r in running if len(r["tokens"]) >= r["until"]]
    keep = [row for row, r in enumerate(running) if len(r["tokens"]) < r["until"]]
    cache.select(keep)
    running[:] = [running[row] for row in keep]
    return done


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32), st.booleans())
def test_every_plan_fits_the_pool_and_a_lone_request_is_admitted(seed, windowed):
    rng = random.Random(seed)
    size, blocks = rng.choice([2, 3, 4]), rng.randint(4, 24)
    limits = Limits(size, rng.randint(1, 4), rng.randint(2, 12))
    cache = _cache(rng, size, blocks, limits, windowed)
    running: list[dict] = []
    waiting: list[dict] = []
    history: list[int] = []
    for step in range(150):
        if len(waiting) + len(running) < 3 and rng.random() < 0.4:  # the next turn, or a fresh start
            start = history if rng.random() < 0.7 else []
            tokens = start + [rng.randrange(3) for _ in range(rng.randint(1, 5))]
            until = len(tokens) + rng.randint(1, 6)
            if blocks_for(until, size) <= blocks:  # (what `check_request` admits to the queue)
                waiting.append({"id": step, "tokens": tokens, "cached": 0, "until": until})
        if running or waiting:
            for request in _step(cache, running, waiting, limits, rng):
                history = request["tokens"]
        for allocator in cache.allocators:
            allocator.check_invariants()
