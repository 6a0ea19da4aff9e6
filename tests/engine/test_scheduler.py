"""The scheduler is a pure function; over random states its plans keep every rule: the token
budget and the running cap, no more blocks than are free, every decoding sequence served unless
preempted, the newest preempted first, first come first served, nothing admitted while memory is
short."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.engine.scheduler import Limits, RunningSeq, WaitingSeq, blocks_for, schedule

SIZE = 4


@st.composite
def states(draw):
    limits = Limits(SIZE, max_running=draw(st.integers(1, 6)), token_budget=draw(st.integers(6, 40)))
    count = draw(st.integers(0, limits.max_running))
    running = []
    for index in range(count):
        tokens = draw(st.integers(1, 40))
        cached = draw(st.sampled_from([tokens - 1, max(0, tokens - draw(st.integers(2, 40)))]))
        blocks = blocks_for(cached, SIZE)
        running.append(RunningSeq(index, index, tokens, max(cached, 0), blocks, draw(st.integers(0, blocks)),
                                  draw(st.integers(0, 8))))  # (a draft it would verify when decoding)
    waiting = []
    for index in range(draw(st.integers(0, 6))):
        tokens = draw(st.integers(1, 40))
        prefix = draw(st.integers(0, (tokens - 1) // SIZE)) * SIZE
        waiting.append(
            WaitingSeq(100 + index, 100 + index, tokens, prefix, draw(st.integers(0, prefix // SIZE)))
        )
    return running, waiting, draw(st.integers(0, 30)), limits, draw(st.none() | st.integers(1, 40))


def _new_blocks(seq_cached: int, blocks: int, count: int) -> int:
    return max(0, blocks_for(seq_cached + count, SIZE) - blocks)


@settings(max_examples=300, deadline=None)
@given(state=states())
def test_every_plan_keeps_the_rules(state):
    running, waiting, free, limits, cap = state
    try:
        plan = schedule(running, waiting, free, limits, cap)
    except RuntimeError:  # the oldest's next token cannot fit even with every other one preempted
        oldest = min(running, key=lambda s: s.arrival)
        others = sum(s.freeable for s in running if s is not oldest)
        assert oldest.tokens - oldest.cached == 1
        assert _new_blocks(oldest.cached, oldest.blocks, 1) > free + others
        return
    by_id = {s.seq_id: s for s in running}
    waits = {w.seq_id: w for w in waiting}
    assert plan.tokens <= limits.token_budget
    if plan.decode and cap is not None:  # beside decoding rows (and drafts) at most the cap
        assert plan.tokens - len(plan.decode) - sum(plan.drafts.values()) <= cap
    # drafts: only decoding sequences', at most what each would draft, never at a preemption's cost
    assert set(plan.drafts) <= set(plan.decode)
    assert all(0 < count <= by_id[i].draft for i, count in plan.drafts.items())
    assert not (plan.preempt and plan.drafts)
    assert len(running) - len(plan.preempt) + len(plan.admit) <= limits.max_running
    kept = [s for s in running if s.seq_id not in plan.preempt]
    # every decoding sequence that was not preempted decodes, exactly once
    assert sorted(plan.decode) == sorted(s.seq_id for s in kept if s.tokens - s.cached == 1)
    # the newest go first
    if plan.preempt:
        assert min(by_id[i].arrival for i in plan.preempt) > max((s.arrival for s in kept), default=-1)
        assert not plan.admit
    # blocks: what the plan takes fits in what was free plus what preempting gave back
    given_back = sum(by_id[i].freeable for i in plan.preempt)
    taken = sum(_new_blocks(by_id[i].cached, by_id[i].blocks, 1 + plan.drafts.get(i, 0)) for i in plan.decode)
    for seq_id, count in plan.prefill:
        if seq_id in by_id:
            seq = by_id[seq_id]
            assert 0 < count <= seq.tokens - seq.cached
            taken += _new_blocks(seq.cached, seq.blocks, count)
        else:
            seq = waits[seq_id]
            assert seq_id in plan.admit and 0 < count <= seq.tokens - seq.prefix
            taken += seq.prefix_idle + _new_blocks(seq.prefix, seq.prefix // SIZE, count)
    assert taken <= free + given_back
    # first come, first served: the admitted are the first of the queue
    assert plan.admit == [w.seq_id for w in waiting[: len(plan.admit)]]


def test_a_long_prompt_is_chunked_while_the_others_decode():
    """Three rows decode; a 1,000-token prompt arrives: each step the three get their token and
    the prompt takes only what is left of the budget."""
    limits = Limits(SIZE, max_running=4, token_budget=32)
    running = [RunningSeq(i, i, 10, 9, 3, 3) for i in range(3)]
    waiting = [WaitingSeq(9, 9, 1000, 0, 0)]
    plan = schedule(running, waiting, free_blocks=1000, limits=limits)
    assert plan.decode == [0, 1, 2] and plan.admit == [9] and plan.prefill == [(9, 29)]


def test_when_decode_blocks_run_out_the_newest_is_preempted():
    limits = Limits(SIZE, max_running=4, token_budget=32)
    running = [RunningSeq(i, i, 9, 8, 2, 2) for i in range(3)]  # each needs a third block now
    plan = schedule(running, [WaitingSeq(9, 9, 5, 0, 0)], free_blocks=1, limits=limits)
    assert plan.preempt == [2] and plan.decode == [0, 1] and not plan.admit  # 2 blocks back: enough
    shared = [RunningSeq(0, 0, 9, 8, 2, 2), RunningSeq(1, 1, 9, 8, 2, 0), RunningSeq(2, 2, 9, 8, 2, 0)]
    plan = schedule(shared, [], free_blocks=1, limits=limits)  # the newest give nothing back (shared)
    assert plan.preempt == [2, 1] and plan.decode == [0]
    with pytest.raises(RuntimeError, match="one running sequence"):
        schedule(running[:1], [], free_blocks=0, limits=limits)


def test_a_draft_gets_what_the_budget_and_the_free_blocks_leave_after_every_next_token():
    limits = Limits(SIZE, max_running=4, token_budget=12)
    running = [RunningSeq(0, 0, 9, 8, 3, 3, draft=6), RunningSeq(1, 1, 9, 8, 3, 3, draft=6)]
    plan = schedule(running, [], free_blocks=1, limits=limits)  # one block more: the oldest's draft
    assert plan.decode == [0, 1] and plan.drafts == {0: 6, 1: 3}  # (the newest's fills its 3rd block)
    plan = schedule(running, [], free_blocks=10, limits=limits)  # the budget: 12 - 2 next tokens
    assert plan.drafts == {0: 6, 1: 4} and plan.tokens == 12
    full = [RunningSeq(0, 0, 12, 11, 3, 3, draft=6), RunningSeq(1, 1, 9, 8, 2, 2, draft=6)]
    plan = schedule(full, [], free_blocks=1, limits=limits)  # the newest's next token takes the block
    assert plan.decode == [0, 1] and plan.drafts == {1: 3} and not plan.preempt  # (none for a full one)
    plan = schedule(full, [], free_blocks=0, limits=limits)  # short: a preemption, and no draft
    assert plan.preempt == [1] and plan.decode == [0] and plan.drafts == {}


def test_a_prefix_hit_costs_only_its_idle_blocks():
    limits = Limits(SIZE, max_running=2, token_budget=32)
    waiting = [WaitingSeq(1, 1, 13, 12, 3)]  # 12 tokens attached (3 blocks, all idle), 1 to run
    assert schedule([], waiting, free_blocks=4, limits=limits).prefill == [(1, 1)]
    assert schedule([], waiting, free_blocks=3, limits=limits).admit == []  # 3 idle + 1 new > 3


def test_a_prompt_that_continues_a_kept_tail_is_admitted_when_its_cache_fills_the_pool():
    """A finished turn fills the pool (3 full blocks and a 2-token tail, all cached); the next
    turn attaches all 14 of its tokens, and the copy of the tail costs no block more than a
    whole-block attach would: it is planned, and the plan fits `reserve`."""
    from kvcache.cache import PagedCache

    cache = PagedCache(4, 4, num_layers=1)
    turn = list(range(100, 114))
    cache.add_sequence(turn[:10])
    cache.reserve([0], [14])
    cache.declare_tokens(0, turn[10:])
    cache.commit([0], [14])
    cache.free_rows()
    prompt = turn + [7]
    prefix, idle = cache.prefix_cost(prompt)
    assert (prefix, idle) == (14, 3)
    plan = schedule([], [WaitingSeq(1, 0, len(prompt), prefix, idle)], cache.allocator.num_allocatable,
                    Limits(block_size=4, max_running=4, token_budget=64))
    assert plan.admit == [1] and plan.prefill == [(1, 1)]
    assert cache.add_sequence(prompt) == 14
    cache.reserve([0], [15])
    cache.allocator.check_invariants()
