"""Block bookkeeping of the paged cache in plain Python (no torch): which block holds what.

A pool of `num_blocks` blocks of `block_size` token slots. Each sequence owns a block table
(block ids in position order); token p of a sequence lives in slot
`table[p // block_size] * block_size + p % block_size` of every layer's storage. Blocks carry a
reference count, so sequences can share them (a fork, or a common prompt prefix). A full block
whose token ids are known gets a hash chained from the prefix (its parent block's hash and its
own token ids), so a later prompt that starts with the same tokens finds it. A block nobody
uses any more but whose hash is registered stays in a pool of cached blocks (least recently
freed evicted first) until a fresh block is needed. A prompt may also start with part of a
cached block: a freed sequence's partial last block (its tail) is kept the same way, and the
leading tokens of any cached block that follows the prompt's whole-block prefix attach too,
copied on the first write (so the cached block stays as it was). Tensor storage lives elsewhere
(`kvcache.cache.paged`); this module returns block ids and the copies to make.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from .errors import CacheConfigError, CacheError, OutOfBlocksError, UnknownSequenceError

ROOT_HASH = b""  # the parent hash of a sequence's first block
HOLE = -1  # a table entry whose block was given back (a windowed allocator's, out of the window)
PARTIAL_CANDIDATES = 16  # blocks per parent hash whose leading tokens a prompt may attach (newest kept)


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block: blake2b over the parent block's hash and the block's token ids."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockListener(Protocol):
    """Told when a full block becomes findable by its hash and when it stops being (evicted,
    rewritten): what a router that scores replicas by the blocks they hold follows
    (`kvcache.engine.kv_events`). Called inside the allocator's operations: keep it cheap."""

    def stored(self, digests: list[bytes], parent: bytes | None, token_ids: list[int]) -> None:
        """Blocks `digests`, a chain in position order, now findable; parent: the hash of the
        block before the first (None for a sequence's first block); token_ids: their tokens."""

    def removed(self, digest: bytes) -> None:
        """The block of hash `digest` is no longer findable."""


@dataclass
class SequenceBlocks:
    """One sequence's view of the pool.

    table: block ids in position order. num_tokens: positions written (or attached). token_ids:
    the ids known for positions 0.. (may run ahead of num_tokens: a prompt declared before its
    forward). hashes: chained hashes of the leading full blocks computed so far.
    """

    table: list[int] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    root: bytes = ROOT_HASH  # the parent hash of its first block (`salt_root`)


def tail_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a partial block (fewer than block_size tokens) kept after its sequence ended:
    never equal to a full block's (`block_hash`), which routers and stores see; this one stays
    inside one allocator."""
    digest = hashlib.blake2b(parent, digest_size=16, person=b"kvcache tail")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def common_prefix(first: Sequence[int], second: Sequence[int]) -> int:
    """How many leading items `first` and `second` share."""
    count = 0
    for a, b in zip(first, second):
        if a != b:
            break
        count += 1
    return count


def prefix_digests(token_ids: Sequence[int], block_size: int, root: bytes = ROOT_HASH) -> list[bytes]:
    """The chained hashes of the whole blocks of `block_size` tokens of `token_ids` that a prefix
    hit may cover: every whole block but one that would hold the last token (which the model must
    run, for its logits), chained from `root`."""
    ids = [int(t) for t in token_ids]
    digests: list[bytes] = []
    parent = root
    for index in range((len(ids) - 1) // block_size if ids else 0):
        parent = block_hash(parent, ids[index * block_size : (index + 1) * block_size])
        digests.append(parent)
    return digests


def salt_root(salt: str | None) -> bytes:
    """The parent hash of a sequence's first block under `salt` (None: ROOT_HASH): sequences of
    different salts never share a block, in the pool or any store (every hash of their chain
    differs)."""
    if salt is None:
        return ROOT_HASH
    return hashlib.blake2b(b"kvcache cache_salt\0" + salt.encode("utf-8"), digest_size=16).digest()


class BlockAllocator:
    """Free list, reference counts, block tables and prefix hashes of a pool of blocks.

    Every block is in exactly one state: free (empty), cached (unused, content still valid and
    findable by its hash) or in use (reference count >= 1), so
    `num_free + num_cached + num_in_use == num_blocks` at all times.
    """

    #: a query at q sees positions in (q - window, q]; None: every position (see window.py)
    window: int | None = None

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CacheConfigError(f"{name} must be an int >= 1, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first
        self._cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self._cached_pinned: OrderedDict[int, None] = OrderedDict()  # the same, evicted last
        self.pinned: Counter[bytes] = Counter()  # digests of pinned prefixes' blocks: their pins (`pin`)
        self._by_hash: dict[bytes, int] = {}
        # registered blocks (full, or kept tails) by their parent's hash, with their token ids: the
        # blocks whose leading tokens a prompt may attach after its whole-block prefix
        self._partials: dict[bytes, OrderedDict[int, tuple[int, ...]]] = {}
        self._partial_parent: dict[int, bytes] = {}
        self.sequences: dict[Hashable, SequenceBlocks] = {}
        self.listener: BlockListener | None = None  # told of blocks stored and removed

    # ---- counts ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Empty blocks."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Unused blocks that still hold a registered full block (evicted when space runs out)."""
        return len(self._cached) + len(self._cached_pinned)

    @property
    def num_in_use(self) -> int:
        """Blocks referenced by at least one sequence."""
        return self.num_blocks - self.num_free - self.num_cached

    @property
    def num_allocatable(self) -> int:
        """Blocks a new allocation may take: free ones, then cached ones by eviction."""
        return self.num_free + self.num_cached

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (the last one possibly partial)."""
        return -(-num_tokens // self.block_size)

    # ---- sequences ---------------------------------------------------------------------------
    def sequence(self, seq_id: Hashable) -> SequenceBlocks:
        """The state of `seq_id`; raises `UnknownSequenceError` if the allocator does not hold it."""
        state = self.sequences.get(seq_id)
        if state is None:
            raise UnknownSequenceError(f"no sequence {seq_id!r} in the allocator")
        return state

    def add_sequence(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int] = (),
        *,
        reuse_prefix: bool = True,
        attach: int | None = None,
        root: bytes = ROOT_HASH,
    ) -> int:
        """Start `seq_id`, declaring its first `token_ids`; return the tokens attached from cache.

        With reuse_prefix, cached full blocks matching the start of token_ids are attached
        (shared, nothing copied), then the leading tokens of a cached block that follow them
        (`partial_match`; copied on the first write): the most this allocator can attach, or
        exactly `attach` tokens (as a cache with several allocators agrees on), leaving at least
        the last token to compute (its logits are what the caller wants). The caller then writes
        positions from the returned count on. root: the parent hash of its first block
        (`salt_root`).
        """
        if seq_id in self.sequences:
            raise UnknownSequenceError(f"sequence {seq_id!r} is already in the allocator")
        state = SequenceBlocks(token_ids=[int(t) for t in token_ids], root=root)
        if reuse_prefix:
            digests = self.prefix_digests(state.token_ids, root)
            count = self.attachable(digests) if attach is None else attach // self.block_size
            if not self.can_attach(digests, count):
                raise CacheError(f"sequence {seq_id!r}: {count} blocks of its prefix are not all cached")
            partial, matched = self.partial_match(state.token_ids, digests, count, root)
            within = matched if attach is None else attach % self.block_size
            if matched < within:
                raise CacheError(f"sequence {seq_id!r}: {within} tokens after {count} blocks of its prefix "
                                 f"are not cached (at most {matched})")
            self._attach(state, digests[:count], partial, within)
        self.sequences[seq_id] = state
        return state.num_tokens

    def prefix_digests(self, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> list[bytes]:
        """The chained hashes of the full blocks of `token_ids` a prefix hit may cover (keeping at
        least the last token to compute): `prefix_digests` of this pool's block size."""
        return prefix_digests(token_ids, self.block_size, root)

    def partial_match(
        self, token_ids: Sequence[int], digests: Sequence[bytes], count: int, root: bytes = ROOT_HASH
    ) -> tuple[int, int]:
        """(block, tokens): the registered block (full, or a freed sequence's tail) following the
        first `count` blocks of `digests` (`prefix_digests(token_ids)`) that shares the most
        leading tokens with token_ids after them: at most block_size - 1, leaving the last
        token to compute. (HOLE, 0) when none shares any."""
        start = count * self.block_size
        wanted = token_ids[start : min(start + self.block_size - 1, len(token_ids) - 1)]
        best, most = HOLE, 0
        for block, tokens in self._partials.get(digests[count - 1] if count else root, {}).items():
            matched = common_prefix(tokens, wanted)
            if matched > most:
                best, most = block, matched
        return best, most

    def pin(self, digests: Sequence[bytes]) -> None:
        """Keep the blocks of `digests` (a pinned prefix's, `prefix_digests`) when nothing uses
        them, evicted only after every other unused block."""
        self.pinned.update(digests)
        for block in [self._by_hash[d] for d in digests if self._by_hash.get(d) in self._cached]:
            self._cached_pinned[block] = self._cached.pop(block)

    def unpin(self, digests: Sequence[bytes]) -> None:
        """Take back one `pin` of each of `digests`; a block no pin holds any more is evicted as
        any unused block is (as the most recently freed)."""
        for digest in digests:
            if self.pinned[digest] > 1:
                self.pinned[digest] -= 1
                continue
            self.pinned.pop(digest, None)
            block = self._by_hash.get(digest)
            if block is not None and block in self._cached_pinned:
                self._cached[block] = self._cached_pinned.pop(block)

    def demote(self, digests: Sequence[bytes]) -> None:
        """Evict the unused, unpinned blocks of `digests` before every other unused block (a tier
        below holds them: they are the cheapest to lose)."""
        for digest in reversed(digests):  # (the chain's first block ends up evicted first)
            block = self._by_hash.get(digest)
            if block is not None and block in self._cached:
                self._cached.move_to_end(block, last=False)

    def attachable(self, digests: Sequence[bytes]) -> int:
        """The most leading blocks of `digests` this allocator can attach: here, the longest run
        of them cached from the first."""
        count = 0
        while count < len(digests) and digests[count] in self._by_hash:
            count += 1
        return count

    def can_attach(self, digests: Sequence[bytes], count: int) -> bool:
        """Whether the first `count` blocks of `digests` can be attached (every block it needs is
        cached: here, all of them)."""
        return all(digest in self._by_hash for digest in self._needed(digests[:count]))

    def _needed(self, digests: Sequence[bytes]) -> Sequence[bytes]:
        """Of an attached prefix's digests, the ones whose blocks are taken: here, all."""
        return digests

    def _attach(self, state: SequenceBlocks, digests: Sequence[bytes], partial: int = HOLE,
                within: int = 0) -> None:
        """Take the cached blocks of `digests` as the start of `state`, then (within > 0) the
        first `within` positions of block `partial` (`partial_match`'s)."""
        for digest in digests:
            block = self._by_hash[digest]
            self._take(block)
            state.table.append(block)
            state.hashes.append(digest)
        self._attach_part(state, partial, within)
        state.num_tokens = len(digests) * self.block_size + within

    def _attach_part(self, state: SequenceBlocks, partial: int, within: int) -> None:
        """`_attach`'s last step: block `partial` after the whole ones, when within > 0."""
        if within:
            self._take(partial)
            state.table.append(partial)

    def idle_blocks(self, digests: Sequence[bytes], count: int) -> int:
        """Of the blocks attaching the first `count` of `digests` takes, the ones no sequence uses."""
        return sum(
            1 for digest in self._needed(digests[:count]) if self.ref_counts[self._by_hash[digest]] == 0
        )

    def unshared_blocks(self, seq_id: Hashable) -> int:
        """Blocks of `seq_id` that no other sequence holds (what freeing it gives back)."""
        table = self.sequence(seq_id).table
        return sum(1 for block in table if block != HOLE and self.ref_counts[block] == 1)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start `child_id` as a copy of `parent_id` that shares all its blocks (copy on write)."""
        parent = self.sequence(parent_id)
        if child_id in self.sequences:
            raise UnknownSequenceError(f"sequence {child_id!r} is already in the allocator")
        # only blocks holding written positions are shared: a block reserved past them stays
        # the parent's, so the only shared block a write can reach is a partial last one
        shared = parent.table[: self.blocks_for(parent.num_tokens)]
        for block in shared:
            if block != HOLE:
                self.ref_counts[block] += 1
        self.sequences[child_id] = SequenceBlocks(
            list(shared), parent.num_tokens, list(parent.token_ids), list(parent.hashes), parent.root
        )

    def free_sequence(self, seq_id: Hashable) -> None:
        """Drop `seq_id`; its blocks lose a reference (tail first, so tails are evicted first). A
        partial last block only it held stays cached (`_keep_tail`)."""
        state = self.sequence(seq_id)
        self._keep_tail(state)
        for block in reversed(state.table):
            if block != HOLE:
                self._release(block)
        del self.sequences[seq_id]

    def declare_tokens(self, seq_id: Hashable, token_ids: Iterable[int], start: int | None = None) -> None:
        """Give the token ids of positions start, start+1, … (default: after those already
        known); ids may run ahead of the written positions, and ids declared earlier from
        `start` on are replaced. Full written blocks whose ids are all known get hashed."""
        state = self.sequence(seq_id)
        if start is not None:
            if not state.num_tokens <= start <= len(state.token_ids):
                raise CacheError(
                    f"sequence {seq_id!r}: token ids may be declared from a position in "
                    f"[{state.num_tokens}, {len(state.token_ids)}] (written positions keep "
                    f"theirs), got start={start}"
                )
            del state.token_ids[start:]
        state.token_ids.extend(int(t) for t in token_ids)
        self._hash_full_blocks(state)

    # ---- writing -----------------------------------------------------------------------------
    def blocks_needed(self, seq_id: Hashable, num_tokens: int) -> int:
        """New blocks `reserve(seq_id, num_tokens)` would take (including a copy on write)."""
        state = self.sequence(seq_id)
        needed = max(0, self.blocks_for(num_tokens) - len(state.table))
        if self._needs_copy(state, num_tokens):
            needed += 1
        return needed

    def _needs_copy(self, state: SequenceBlocks, num_tokens: int) -> bool:
        """Whether the next write lands in a partial last block that another sequence shares or
        that is registered (findable by others: a block attached in part, a kept tail)."""
        if num_tokens <= state.num_tokens or state.num_tokens % self.block_size == 0:
            return False
        last = state.table[state.num_tokens // self.block_size]
        return self.ref_counts[last] > 1 or self.block_hashes[last] is not None

    def reserve(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Give each sequence room for `num_tokens` positions in total; all or nothing.

        Returns the (source block, destination block) copies to make in storage before writing:
        a shared partial last block is copied on write. Raises `OutOfBlocksError` (changing
        nothing) when the pool cannot supply every block asked for.
        """
        self.check_reserve(seq_ids, num_tokens)
        copies: list[tuple[int, int]] = []
        for seq_id, total in zip(seq_ids, num_tokens):
            state = self.sequences[seq_id]
            if self._needs_copy(state, total):
                index = state.num_tokens // self.block_size
                source = state.table[index]
                self._release(source)  # first: when nothing else holds it, it may be the block we get
                target = self._allocate()
                state.table[index] = target
                if target != source:  # (else it was evicted from the cache: written in place)
                    copies.append((source, target))
            while len(state.table) < self.blocks_for(total):
                state.table.append(self._allocate())
        return copies

    def check_reserve(self, seq_ids: Sequence[Hashable], num_tokens: Sequence[int]) -> None:
        """Raise `OutOfBlocksError` unless `reserve(seq_ids, num_tokens)` can supply every block:
        the new blocks (copies on write included) against the allocatable ones and the blocks
        whose every holder copies from them here (each released before its copy is taken)."""
        states = [self.sequence(seq_id) for seq_id in seq_ids]
        if len(set(seq_ids)) != len(states) or len(states) != len(num_tokens):
            raise CacheError(f"reserve needs distinct sequences, one total each; got {list(seq_ids)}")
        requested = sum(self.blocks_needed(seq_id, n) for seq_id, n in zip(seq_ids, num_tokens))
        sources = Counter(state.table[state.num_tokens // self.block_size]
                          for state, total in zip(states, num_tokens) if self._needs_copy(state, total))
        available = self.num_allocatable + sum(1 for block, count in sources.items()
                                               if self.ref_counts[block] == count)
        if requested > available:
            raise OutOfBlocksError(requested, available, self.num_blocks)

    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that positions up to `num_tokens` are written (after `reserve` made room)."""
        state = self.sequence(seq_id)
        if num_tokens > len(state.table) * self.block_size:
            raise CacheError(
                f"sequence {seq_id!r}: {num_tokens} positions committed but its blocks hold "
                f"{len(state.table) * self.block_size}; reserve first"
            )
        state.num_tokens = max(state.num_tokens, num_tokens)
        self._hash_full_blocks(state)

    def validate_truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Raise CacheCropError if `truncate(seq_id, num_tokens)` is impossible (nothing here:
        every position is still held)."""

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions of `seq_id`; later blocks lose a reference (a
        registered block left partial is copied on the next write, so it stays findable)."""
        state = self.sequence(seq_id)
        if num_tokens >= state.num_tokens:
            return
        keep = self.blocks_for(num_tokens)
        for block in reversed(state.table[keep:]):
            if block != HOLE:
                self._release(block)
        del state.table[keep:]
        state.num_tokens = num_tokens
        del state.token_ids[num_tokens:]
        del state.hashes[num_tokens // self.block_size :]

    def slots(self, seq_id: Hashable, start: int, stop: int) -> list[int]:
        """Storage slots of positions start..stop-1 of `seq_id` (they must be reserved, and held:
        a windowed allocator has given back the blocks its window left behind)."""
        table, size = self.sequence(seq_id).table, self.block_size
        if stop > len(table) * size or start < 0:
            raise CacheError(
                f"sequence {seq_id!r}: positions {start}..{stop - 1} asked, blocks hold {len(table) * size}"
            )
        slots = [table[pos // size] * size + pos % size for pos in range(start, stop)]
        if start < stop and (table[start // size] == HOLE):
            raise CacheError(f"sequence {seq_id!r}: position {start} is out of its window (given back)")
        return slots

    # ---- block states ------------------------------------------------------------------------
    def _allocate(self) -> int:
        if self._free:
            block = self._free.pop()
        elif self._cached or self._cached_pinned:  # least recently freed, pinned ones last
            block, _ = (self._cached or self._cached_pinned).popitem(last=False)
            self._unregister(block)
        else:  # reserve() checked the count first
            raise OutOfBlocksError(1, 0, self.num_blocks)
        self.ref_counts[block] = 1
        return block

    def _take(self, block: int) -> None:
        """One more reference to a block found by its hash (in use, or cached)."""
        if self.ref_counts[block] == 0:
            (self._cached_pinned if block in self._cached_pinned else self._cached).pop(block)
        self.ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] > 0:
            return
        if self.block_hashes[block] is not None:  # keeps its content for a later prefix hit
            (self._cached_pinned if self.block_hashes[block] in self.pinned else self._cached)[block] = None
        else:
            self._free.append(block)

    def _unregister(self, block: int) -> None:
        digest = self.block_hashes[block]
        if digest is not None:
            self.block_hashes[block] = None
            parent = self._partial_parent.pop(block, None)
            if parent is not None:
                del self._partials[parent][block]
                if not self._partials[parent]:
                    del self._partials[parent]
            if self._by_hash.get(digest) == block:
                del self._by_hash[digest]
                if self.listener is not None:
                    self.listener.removed(digest)

    def _hash_full_blocks(self, state: SequenceBlocks) -> None:
        size = self.block_size
        known = min(state.num_tokens, len(state.token_ids)) // size
        run: list[int] = []  # indices of the blocks registered in a row, for the listener
        while len(state.hashes) < known:
            index = len(state.hashes)
            parent = state.hashes[-1] if state.hashes else state.root
            digest = block_hash(parent, state.token_ids[index * size : (index + 1) * size])
            state.hashes.append(digest)
            block = state.table[index]
            if block != HOLE and digest not in self._by_hash and self.block_hashes[block] is None:
                self._by_hash[digest] = block
                self.block_hashes[block] = digest
                self._index_partial(parent, block, tuple(state.token_ids[index * size : (index + 1) * size]))
                run.append(index)
            elif run:
                self._tell_stored(state, run)
                run = []
        if run:
            self._tell_stored(state, run)

    def _keep_tail(self, state: SequenceBlocks) -> None:
        """Register `state`'s partial last block (written, its ids known, held by it alone) under
        `tail_hash`, so it stays cached when freed and a later prompt that continues the same
        way attaches its tokens (unless a kept block already starts with them)."""
        size = self.block_size
        index, filled = divmod(state.num_tokens, size)
        if not filled or len(state.token_ids) < state.num_tokens or len(state.hashes) < index:
            return
        block = state.table[index]
        if block == HOLE or self.ref_counts[block] != 1 or self.block_hashes[block] is not None:
            return
        parent = state.hashes[index - 1] if index else state.root
        tokens = tuple(state.token_ids[index * size : state.num_tokens])
        if any(common_prefix(kept, tokens) == filled for kept in self._partials.get(parent, {}).values()):
            return
        self.block_hashes[block] = tail_hash(parent, tokens)
        self._index_partial(parent, block, tokens)

    def _index_partial(self, parent: bytes, block: int, tokens: tuple[int, ...]) -> None:
        """List registered `block` (holding `tokens`) under `parent` for `partial_match`, the
        newest PARTIAL_CANDIDATES per parent; a kept tail pushed out is no longer cached."""
        children = self._partials.setdefault(parent, OrderedDict())
        children[block] = tokens
        self._partial_parent[block] = parent
        if len(children) > PARTIAL_CANDIDATES:
            oldest = next(iter(children))
            del children[oldest], self._partial_parent[oldest]
            if self._by_hash.get(self.block_hashes[oldest]) != oldest:  # a tail: findable no more
                self.block_hashes[oldest] = None
                if self.ref_counts[oldest] == 0:
                    self._cached.pop(oldest)
                    self._free.append(oldest)

    def _tell_stored(self, state: SequenceBlocks, run: list[int]) -> None:
        """The listener's `stored` for the consecutive blocks `run` (indices) of `state`."""
        if self.listener is None:
            return
        first, size = run[0], self.block_size
        self.listener.stored(
            state.hashes[first : run[-1] + 1],
            state.hashes[first - 1] if first else None,
            list(state.token_ids[first * size : (run[-1] + 1) * size]),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees with itself (used by tests)."""
        in_tables = [0] * self.num_blocks
        for state in self.sequences.values():
            assert len(state.table) >= self.blocks_for(state.num_tokens), "table too short"
            for block in state.table:
                if block != HOLE:
                    in_tables[block] += 1
        assert in_tables == self.ref_counts, "reference counts differ from the block tables"
        free, cached = set(self._free), set(self._cached) | set(self._cached_pinned)
        assert len(free) == len(self._free) and not free & cached, "a block listed twice"
        for block in range(self.num_blocks):
            used = self.ref_counts[block] > 0
            assert used + (block in free) + (block in cached) == 1, f"block {block} in 2 states"
            if block in free:
                assert self.block_hashes[block] is None, f"free block {block} still hashed"
            if block in cached:
                assert self.block_hashes[block] is not None, f"cached block {block} not hashed"
        for digest, block in self._by_hash.items():
            assert self.block_hashes[block] == digest, "hash index points at the wrong block"
        listed = {block: parent for parent, children in self._partials.items() for block in children}
        assert listed == self._partial_parent and all(children for children in self._partials.values())
        assert all(self.block_hashes[block] is not None for block in listed), "an unregistered block listed"
        assert self.num_free + self.num_cached + self.num_in_use == self.num_blocks
