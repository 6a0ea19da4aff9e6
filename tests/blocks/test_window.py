"""WindowedBlockAllocator: over random adds (with prefix hits), writes, forks, truncations and
frees, every sequence holds exactly the blocks its window still needs (the rest are holes at the
front of its table), never more than `window_blocks_per_sequence`, the bookkeeping stays whole,
and a prefix hit attaches only blocks whose hashes match the prompt."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.blocks import HOLE
from kvcache.blocks.window import WindowedBlockAllocator
from kvcache.cache.errors import CacheCropError, OutOfBlocksError
from kvcache.memory import window_blocks_per_sequence

SIZE = 4
ACTION = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 3), st.integers(1, 30)),  # prompt family, length
    st.tuples(st.just("write"), st.integers(0, 9), st.integers(1, 9)),  # sequence, new tokens
    st.tuples(st.just("fork"), st.integers(0, 9), st.just(0)),
    st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 30)),
    st.tuples(st.just("free"), st.integers(0, 9), st.just(0)),
)


def _check(pool: WindowedBlockAllocator, chunk: int) -> None:
    pool.check_invariants()
    for seq, state in pool.sequences.items():
        first = max(0, state.num_tokens - pool.window + 1) // SIZE
        held = [index for index, block in enumerate(state.table) if block != HOLE]
        assert all(block == HOLE for block in state.table[:first]), seq  # holes are the front
        assert held == list(range(first, len(state.table))), (seq, state.table, state.num_tokens)
        assert len(held) <= window_blocks_per_sequence(pool.window, SIZE, chunk)
        assert state.hashes == pool.prefix_digests(state.token_ids + [0])[: len(state.hashes)]


@settings(max_examples=150, deadline=None)
@given(window=st.integers(1, 9), actions=st.lists(ACTION, max_size=30))
def test_a_sequence_holds_only_what_its_window_needs(window, actions):
    pool = WindowedBlockAllocator(64, SIZE, window)
    prompts = [[family * 100 + i for i in range(40)] for family in range(4)]
    alive: list[int] = []
    next_id = 0
    for action, a, b in actions:
        if action == "add":
            ids = prompts[a][:b]
            pool.add_sequence(next_id, ids)
            alive.append(next_id)
            next_id += 1
        elif alive and action == "write":
            seq = alive[a % len(alive)]
            state = pool.sequence(seq)
            total = state.num_tokens + b
            try:
                pool.reserve([seq], [total])
            except OutOfBlocksError:
                continue
            if len(state.token_ids) < total:
                pool.declare_tokens(seq, [7] * (total - len(state.token_ids)))
            pool.commit(seq, total)
        elif alive and action == "fork":
            pool.fork(alive[a % len(alive)], next_id)
            alive.append(next_id)
            next_id += 1
        elif alive and action == "truncate":
            seq = alive[a % len(alive)]
            state = pool.sequence(seq)
            first_held = next((i for i, block in enumerate(state.table) if block != HOLE), len(state.table))
            keep = min(b, state.num_tokens)
            needed = max(0, keep - window + 1) // SIZE
            if 0 < keep < state.num_tokens and needed < first_held:
                with pytest.raises(CacheCropError):
                    pool.truncate(seq, keep)
            else:
                pool.truncate(seq, keep)
        elif alive and action == "free":
            pool.free_sequence(alive.pop(a % len(alive)))
        _check(pool, chunk=9)


def test_a_turn_that_continues_a_kept_tail_fits_the_pool_the_engine_sizes_for_one_sequence():
    block, window, chunk = 16, 64, 64  # the engine sizes a window's pool per running sequence
    pool = WindowedBlockAllocator(window_blocks_per_sequence(window, block, chunk), block, window)
    turn = list(range(1000, 1100))
    pool.add_sequence("turn", turn)
    for end in (64, 100):
        pool.reserve(["turn"], [end])
        pool.commit("turn", end)
    pool.free_sequence("turn")  # 6 whole blocks (the last 2 held) and a 4-token tail
    attached = pool.add_sequence("next", turn + list(range(200)))
    assert attached == 100
    assert sum(b != HOLE for b in pool.sequence("next").table) == window // block + 1  # its window
    pool.reserve(["next"], [attached + chunk])  # the tail's copy, then the chunk's blocks: they fit
    pool.check_invariants()


def test_a_prefix_hit_takes_only_the_windows_blocks():
    pool = WindowedBlockAllocator(32, SIZE, window=6)
    prompt = list(range(30))
    pool.add_sequence("a", prompt)
    pool.reserve(["a"], [30])
    pool.commit("a", 30)  # holds positions 25..29 (blocks 6, 7), gave back blocks 0..5 (hashed)
    assert pool.sequence("a").table[:6] == [HOLE] * 6
    pool.free_sequence("a")  # everything cached now
    attached = pool.add_sequence("b", prompt + [99])  # 7 whole blocks, then a's tail: 30 tokens
    assert attached == 30
    table = pool.sequence("b").table
    # the window of position 29 starts at 24: blocks 6 and 7 (a's tail), as a held them
    assert table == [HOLE] * ((30 - 6 + 1) // SIZE) + pool.sequence("b").table[6:] and HOLE not in table[6:]
    digests = pool.prefix_digests(prompt + [99])
    count = pool.attachable(digests)
    # (whole blocks alone would take block 5 too: the window of position 27 starts at 22)
    assert (count * pool.block_size, pool.idle_blocks(digests, count)) == (28, 1)
    pool.check_invariants()
