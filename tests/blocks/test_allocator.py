"""The block allocator: counts, prefix hashes, copy on write, eviction, and random operation
sequences that must keep the bookkeeping consistent."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.blocks import ROOT_HASH, BlockAllocator, block_hash
from kvcache.blocks.allocator import PARTIAL_CANDIDATES
from kvcache.cache.errors import CacheError, OutOfBlocksError, UnknownSequenceError


@pytest.mark.processes
def test_allocator_runs_where_torch_cannot_be_imported():
    script = """
import sys
sys.modules["torch"] = None  # every torch import fails
from kvcache.blocks import BlockAllocator
pool = BlockAllocator(4, 2)
pool.add_sequence("a", [1, 2, 3])
pool.reserve(["a"], [3])
pool.commit("a", 3)
pool.check_invariants()
print(pool.num_in_use)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["2"]


def write(pool: BlockAllocator, seq, total: int) -> list[tuple[int, int]]:
    copies = pool.reserve([seq], [total])
    pool.commit(seq, total)
    return copies


def test_slots_follow_the_block_table():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("a")
    write(pool, "a", 6)
    table = pool.sequence("a").table
    assert len(table) == 2
    assert pool.slots("a", 0, 6) == [table[p // 4] * 4 + p % 4 for p in range(6)]
    assert (pool.num_free, pool.num_in_use, pool.num_cached) == (6, 2, 0)


def test_exhausted_pool_raises_with_counts_and_changes_nothing():
    pool = BlockAllocator(3, 4)
    pool.add_sequence("a")
    pool.add_sequence("b")
    write(pool, "a", 8)
    with pytest.raises(OutOfBlocksError) as caught:
        pool.reserve(["a", "b"], [9, 4])  # a needs 1 more, b needs 1: 2 asked, 1 free
    assert (caught.value.requested, caught.value.available) == (2, 1)
    assert "2 more block(s) needed, 1 available" in str(caught.value)
    assert pool.sequence("b").table == [] and len(pool.sequence("a").table) == 2
    pool.check_invariants()


def test_full_blocks_are_hashed_from_the_prefix_and_found_again():
    pool = BlockAllocator(16, 4)
    tokens = list(range(10))
    pool.add_sequence("a", tokens)
    write(pool, "a", 10)
    first = block_hash(b"", tokens[:4])
    assert pool.sequence("a").hashes == [first, block_hash(first, tokens[4:8])]
    # the same 4 tokens after a different block hash differently: hashes chain the prefix
    assert block_hash(block_hash(b"", [9, 9, 9, 9]), tokens[4:8]) != pool.sequence("a").hashes[1]
    assert attached_tokens(pool, tokens + [99]) == 8
    assert attached_tokens(pool, tokens[:8]) == 4  # at least one token is left to compute
    assert attached_tokens(pool, [0, 1, 2, 5, 4, 5, 6, 7, 8]) == 0
    pool.free_sequence("a")
    assert (pool.num_cached, pool.num_in_use) == (3, 0)  # the partial block is kept too (its tail)
    attached = pool.add_sequence("b", tokens + [99])
    assert attached == 10 and pool.num_cached == 0 and pool.num_in_use == 3
    pool.check_invariants()


def test_a_prompt_attaches_the_leading_tokens_of_a_cached_block_and_copies_it_on_write():
    pool = BlockAllocator(16, 4)
    tokens = list(range(12))
    pool.add_sequence("a", tokens)
    write(pool, "a", 12)
    full = pool.sequence("a").table
    # 4 whole tokens, then 2 of the block holding 4..7 (the third differs)
    assert pool.add_sequence("b", [0, 1, 2, 3, 4, 5, 50, 51]) == 6
    assert pool.sequence("b").table == full[:2] and pool.ref_counts[full[1]] == 2
    pool.free_sequence("a")
    copies = write(pool, "b", 8)  # the shared, findable block is copied before the write
    assert copies == [(full[1], pool.sequence("b").table[1])] and copies[0][1] not in full
    assert attached_tokens(pool, tokens + [99]) == 12  # a's blocks are all still findable
    # a prompt that is all in the cache but its last token attaches one token less
    assert pool.add_sequence("c", [0, 1, 2, 3, 4, 5, 6]) == 6
    pool.check_invariants()


def test_a_finished_sequences_partial_last_block_is_kept_for_the_next_turn():
    pool = BlockAllocator(8, 4)
    turn = [1, 2, 3, 4, 5, 6]  # the prompt and its answer, as written
    pool.add_sequence("first", turn)
    write(pool, "first", 6)
    tail = pool.sequence("first").table[1]
    pool.free_sequence("first")
    assert pool.num_cached == 2 and pool.block_hashes[tail] is not None
    assert pool.attachable(pool.prefix_digests(turn + [7, 8, 9])) == 1  # only one full block
    assert pool.add_sequence("next", turn + [7, 8, 9]) == 6  # ...and the tail's two tokens
    assert pool.sequence("next").table[1] == tail
    write(pool, "next", 9)
    assert pool.sequence("next").table[1] != tail and pool.ref_counts[tail] == 0  # copied
    assert pool.add_sequence("again", turn + [0]) == 6  # the tail is still there for others
    pool.check_invariants()
    pool.free_sequence("again")  # it held the tail without writing: still kept, once
    assert pool.num_cached == 1 and pool.ref_counts[tail] == 0
    # a tail whose tokens a kept block already starts with is not kept again
    pool.add_sequence("same", turn, reuse_prefix=False)
    write(pool, "same", 6)
    pool.free_sequence("same")
    assert pool.num_cached == 1
    pool.check_invariants()


def test_shared_prefix_blocks_are_counted_once_and_released_when_both_finish():
    pool = BlockAllocator(16, 4)
    prompt = list(range(9))
    pool.add_sequence("a", prompt)
    write(pool, "a", 9)
    assert pool.add_sequence("b", prompt[:8] + [50, 51]) == 8
    shared = pool.sequence("a").table[:2]
    assert pool.sequence("b").table == shared
    assert [pool.ref_counts[block] for block in shared] == [2, 2]
    pool.free_sequence("a")  # (its partial last block, token 8, is kept as its tail)
    assert [pool.ref_counts[block] for block in shared] == [1, 1] and pool.num_cached == 1
    pool.free_sequence("b")
    assert pool.num_cached == 3 and pool.num_in_use == 0
    pool.check_invariants()


def test_fork_shares_blocks_and_copies_the_partial_last_block_on_write():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("parent")
    write(pool, "parent", 6)
    pool.fork("parent", "child")
    assert pool.sequence("child").table == pool.sequence("parent").table
    assert pool.num_in_use == 2
    copies = write(pool, "child", 7)  # writes into the shared partial block 1
    parent_table, child_table = pool.sequence("parent").table, pool.sequence("child").table
    assert copies == [(parent_table[1], child_table[1])]
    assert child_table[0] == parent_table[0] and child_table[1] != parent_table[1]
    assert pool.ref_counts[parent_table[1]] == 1
    assert write(pool, "parent", 7) == []  # the parent now owns its block alone: no copy
    pool.check_invariants()


def test_fork_at_a_block_boundary_copies_nothing():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("a")
    write(pool, "a", 8)
    pool.fork("a", "b")
    assert write(pool, "b", 9) == [] and pool.blocks_needed("a", 9) == 1


def test_fork_does_not_share_a_block_reserved_by_a_forward_that_never_wrote():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("a")
    write(pool, "a", 4)
    pool.reserve(["a"], [6])  # a forward reserved block 1, then failed before writing
    pool.fork("a", "b")
    assert pool.sequence("b").table == pool.sequence("a").table[:1]
    write(pool, "b", 6)
    assert pool.sequence("b").table[1] != pool.sequence("a").table[1]
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first():
    pool = BlockAllocator(4, 2)
    for name, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        pool.add_sequence(name, tokens)
        write(pool, name, 3)
    a_block, b_block = pool.sequence("a").table[0], pool.sequence("b").table[0]
    pool.free_sequence("a")
    pool.free_sequence("b")
    assert pool.num_cached == 4 and pool.num_free == 0  # (each one's full block and its tail)
    pool.add_sequence("c")
    write(pool, "c", 6)  # 3 blocks: evicts a's tail, a's block, then b's tail (freed first)
    assert a_block in pool.sequence("c").table
    assert attached_tokens(pool, [1, 2, 3]) == 0 and attached_tokens(pool, [4, 5, 6]) == 2
    assert pool.ref_counts[b_block] == 0
    pool.check_invariants()


def test_a_kept_block_that_is_the_last_one_allocatable_is_written_in_place_not_copied():
    pool = BlockAllocator(4, 4)
    pool.add_sequence("turn", list(range(14)))
    write(pool, "turn", 14)  # 3 full blocks and a 2-token tail: the whole pool
    pool.free_sequence("turn")
    assert pool.add_sequence("next", list(range(15))) == 14 and pool.num_allocatable == 0
    tail = pool.sequence("next").table[3]
    assert pool.blocks_needed("next", 15) == 1  # a copy of the kept tail...
    assert write(pool, "next", 15) == []  # ...which, released first, is the block it gets back
    assert pool.sequence("next").table[3] == tail and pool.block_hashes[tail] is None
    pool.check_invariants()
    with pytest.raises(OutOfBlocksError):  # (and a block more than that is refused as before)
        pool.reserve(["next"], [17])


def test_an_attach_it_cannot_make_changes_nothing():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("a", list(range(6)))
    write(pool, "a", 6)
    pool.free_sequence("a")
    with pytest.raises(CacheError, match="2 tokens after 1 blocks of its prefix are not cached"):
        pool.add_sequence("b", [0, 1, 2, 3, 50, 51, 52], attach=6)
    assert "b" not in pool.sequences and pool.num_in_use == 0
    pool.check_invariants()


def test_the_newest_blocks_of_a_parent_are_the_ones_matched_within_and_old_tails_leave_the_cache():
    pool = BlockAllocator(64, 4)
    for index in range(PARTIAL_CANDIDATES + 1):  # tails [index, index] after the same first block
        pool.add_sequence(index, [0, 1, 2, 3, 100 + index, 100 + index])
        write(pool, index, 6)
        pool.free_sequence(index)
    assert pool.num_cached == 1 + PARTIAL_CANDIDATES  # the first tail was pushed out: free again
    assert pool.add_sequence("old", [0, 1, 2, 3, 100, 100, 7]) == 4
    assert pool.add_sequence("new", [0, 1, 2, 3, 116, 116, 7]) == 6
    pool.check_invariants()


def test_truncate_releases_blocks_and_copies_a_findable_block_before_rewriting_it():
    pool = BlockAllocator(8, 4)
    pool.add_sequence("a", list(range(12)))
    write(pool, "a", 12)
    pool.truncate("a", 6)
    state = pool.sequence("a")
    assert len(state.table) == 2 and state.num_tokens == 6 and len(state.hashes) == 1
    kept = state.table[1]
    assert pool.block_hashes[kept] is not None
    assert attached_tokens(pool, list(range(12))) == 8
    assert write(pool, "a", 7) == [(kept, state.table[1])]
    assert attached_tokens(pool, list(range(12))) == 8  # the block 4..7 is still findable
    pool.check_invariants()


def test_unknown_and_duplicate_sequences_are_named_errors():
    pool = BlockAllocator(2, 2)
    with pytest.raises(UnknownSequenceError, match="no sequence 'x'"):
        pool.free_sequence("x")
    pool.add_sequence("a")
    with pytest.raises(UnknownSequenceError, match="already"):
        pool.add_sequence("a")
    with pytest.raises(ValueError, match="block_size must be an int >= 1"):
        BlockAllocator(2, 0)


operation = st.one_of(
    st.tuples(st.just("add"), st.lists(st.integers(0, 2), max_size=12)),
    st.tuples(st.just("write"), st.integers(0, 9), st.integers(1, 6)),
    st.tuples(st.just("fork"), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 9)),
    st.tuples(st.just("truncate"), st.integers(0, 9), st.integers(0, 12)),
    st.tuples(st.just("declare"), st.integers(0, 9), st.lists(st.integers(0, 2), max_size=6)),
    st.tuples(st.just("reserve"), st.integers(0, 9), st.integers(1, 6)),  # a forward that failed
)


class FindableBlocks:
    """A listener that keeps what a router would: the hashes findable, from the events alone;
    it checks each stored chain against its tokens and that nothing is stored twice or removed
    before it was stored."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.findable = block_size, set()

    def stored(self, digests, parent, token_ids):
        assert len(token_ids) == len(digests) * self.block_size
        for index, digest in enumerate(digests):
            chunk = token_ids[index * self.block_size : (index + 1) * self.block_size]
            assert digest == block_hash(ROOT_HASH if parent is None else parent, chunk)
            assert digest not in self.findable, "stored twice without a removal between"
            self.findable.add(digest)
            parent = digest

    def removed(self, digest):
        self.findable.remove(digest)  # KeyError: removed without being stored


@settings(max_examples=120, deadline=None)
@given(st.lists(operation, max_size=40), st.integers(2, 10), st.integers(1, 4))
def test_random_operations_keep_counts_consistent_and_hashes_true(operations, num_blocks, block_size):
    pool = BlockAllocator(num_blocks, block_size)
    pool.listener = listener = FindableBlocks(block_size)  # the events tell the findable blocks
    # each sequence has a true token stream; a write stores the true tokens of its positions,
    # so a registered hash must describe exactly what its block holds
    truth: dict[int, list[int]] = {}
    content: dict[int, list[int | None]] = {}
    live: list[int] = []
    next_id = 0

    def true_tokens(seq: int, stop: int) -> list[int]:
        stream = truth[seq]
        while len(stream) < stop:
            stream.append((seq * 31 + len(stream)) % 3)
        return stream[:stop]

    for op in operations:
        kind = op[0]
        if kind == "add":
            pool.add_sequence(next_id, op[1])
            truth[next_id] = list(op[1])
            live.append(next_id)
            next_id += 1
        elif live and kind == "fork":
            parent = live[op[1] % len(live)]
            state = pool.sequence(parent)
            pool.fork(parent, next_id)
            truth[next_id] = true_tokens(parent, max(state.num_tokens, len(state.token_ids)))
            live.append(next_id)
            next_id += 1
        elif live and kind == "free":
            pool.free_sequence(live.pop(op[1] % len(live)))
        elif live and kind == "truncate":
            seq = live[op[1] % len(live)]
            pool.truncate(seq, min(op[2], pool.sequence(seq).num_tokens))
        elif live and kind == "declare":
            seq = live[op[1] % len(live)]
            known = len(pool.sequence(seq).token_ids)
            pool.declare_tokens(seq, true_tokens(seq, known + len(op[2]))[known:])
        elif live and kind == "reserve":
            seq = live[op[1] % len(live)]
            try:
                for source, target in pool.reserve([seq], [pool.sequence(seq).num_tokens + op[2]]):
                    content[target] = list(content[source])
            except OutOfBlocksError:
                pass
        elif live and kind == "write":
            seq = live[op[1] % len(live)]
            start = pool.sequence(seq).num_tokens
            total = start + op[2]
            free_before = pool.num_allocatable
            try:
                copies = pool.reserve([seq], [total])
            except OutOfBlocksError as error:
                assert error.requested > free_before == error.available
                pool.check_invariants()
                continue
            for source, target in copies:
                assert pool.ref_counts[target] == 1
                content[target] = list(content[source])
            tokens = true_tokens(seq, total)
            for position, slot in zip(range(start, total), pool.slots(seq, start, total)):
                block = slot // block_size
                assert pool.ref_counts[block] == 1, "a write landed in a block another sequence holds"
                assert pool.block_hashes[block] is None, "a write landed in a findable block"
                # a position's row depends on every token up to it (as keys do), not on its own
                row = tuple(tokens[: position + 1])
                content.setdefault(block, [None] * block_size)[slot % block_size] = row
            pool.commit(seq, total)
        pool.check_invariants()
        # (a kept tail's hash is registered too, but only full blocks are told: `attachable`)
        assert listener.findable == {d for d in pool.block_hashes if d is not None and pool.attachable([d])}
        assert pool.num_free + pool.num_in_use + pool.num_cached == num_blocks
        holders = {block for s in live for block in pool.sequence(s).table}
        assert not holders & set(pool._free), "a block in use is on the free list"
        for seq in live:  # every position held (written, or attached) holds its true token
            state = pool.sequence(seq)
            expected = true_tokens(seq, state.num_tokens)
            for position in range(state.num_tokens):
                block, slot = divmod(position, block_size)
                assert content[state.table[block]][slot] == tuple(expected[: position + 1])


def attached_tokens(pool: BlockAllocator, tokens: list[int]) -> int:
    """Tokens at the start of `tokens` a new sequence would attach (what add_sequence takes)."""
    return pool.attachable(pool.prefix_digests(tokens)) * pool.block_size


def test_pinned_blocks_are_evicted_only_after_every_other_unused_block():
    pool = BlockAllocator(num_blocks=6, block_size=2)
    pinned, other = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    for name, tokens in (("pinned", pinned), ("other", other)):
        pool.add_sequence(name, tokens)
        pool.reserve([name], [len(tokens)])
        pool.commit(name, len(tokens))
        pool.free_sequence(name)  # both cached now, "pinned" the least recently freed
    pool.pin(pool.prefix_digests(pinned + [0]))
    pool.add_sequence("new", [20, 21])
    pool.reserve(["new"], [2 + 3 * 2])  # 4 blocks: the 2 free ones, then the 2 unpinned cached ones
    assert attached_tokens(pool, pinned) == 4 and attached_tokens(pool, other) == 0
    pool.check_invariants()
    pool.add_sequence("more", [30])
    pool.reserve(["more"], [2 * 2])  # 2 more: only the pinned ones are left to evict
    assert attached_tokens(pool, pinned) == 0
    pool.check_invariants()
