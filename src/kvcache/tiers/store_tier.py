"""The connector over a block store (`TierConnector`): the engine's second tier of prefix blocks,
a disk folder or Redis shared by replicas (or both, `tiered_store.TieredStore`).

When a request is queued, its prompt's full blocks that the pool does not hold are read from the
store on the store's reader thread (the longest run, in two round trips: `lookup`), and the
request is admitted once the answer came or its time is up, so no step waits for the store.
When a chunk of the prompt is about to be prefilled, the blocks read that fall in it are checked
and written into the request's row as if a forward had computed them (`load`); prefill then runs
only the rest. After each step, full blocks of the running rows that the store has not seen are
copied out and queued for the background writer (`save`). The pool stays the first tier: what it
holds is never fetched. Each request's read is kept here by its id (`KVConnector`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from kvcache.blocks import HOLE
from kvcache.cache import OutOfBlocksError, PagedCache
from kvcache.tiers.block_codec import (
    InvalidBlock,
    block_key,
    decode_block,
    encode_block,
    layout_of,
    namespace,
)
from kvcache.tiers.block_store import PendingRead
from kvcache.tiers.connector import KVConnector

log = logging.getLogger("kvcache.store")
_KNOWN = 1 << 16  # digests remembered as stored (written or read back), least recent forgotten first


@dataclass(eq=False)
class StoreRead:
    """A prompt's blocks being read from the store: `digests` are its blocks from index `start`
    (the pool held those before) of the prompt's whole blocks `prompt`, `pending` the store's read."""

    start: int
    digests: list[bytes]
    pending: PendingRead
    prompt: list[bytes]
    missing_forgotten: bool = False

    def ready(self) -> bool:
        """Whether the request may be admitted: the answer came or its time is up."""
        return self.pending.ready()

    @property
    def end(self) -> int:
        """The block index after the last one asked for."""
        return self.start + len(self.digests)


class TierConnector(KVConnector):
    """Shares `pool`'s full prefix blocks of `model` through `store` (see the module docstring)."""

    def __init__(self, store, model, pool: PagedCache) -> None:
        self.store = store
        self.block_size = pool.block_size
        self.layout = layout_of(model, pool.block_size, pool.kv_dtype)
        self.space = namespace(model, self.layout)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._failures = store.failure_count()
        self._warned_invalid = False
        self.max_blocks = pool.num_blocks  # more than the pool holds could never be attached
        self._reads: dict[Hashable, StoreRead] = {}  # request id -> its read, until it lets go
        self._reading = threading.Lock()  # guards _reads (submitting threads, and the engine's)
        self._paused = False
        self._events = None  # the KV events' publisher (`listen`); None: no one is told
        self._lineage: OrderedDict[bytes, tuple[bytes | None, list[int]]] = OrderedDict()  # for events

    @contextlib.contextmanager
    def warming(self):
        """Neither read nor written meanwhile (the engine's warm-up: its blocks are no one's to
        share, and no store read should slow it)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def _remember(self, digest: bytes) -> None:
        self._known[digest] = None
        self._known.move_to_end(digest)
        if len(self._known) > _KNOWN:
            self._known.popitem(last=False)

    def _check_restart(self) -> None:
        """After a failure that may have lost blocks the store took (`failure_count`: a write that
        failed after its block was queued, a Redis restarted empty; not a disk read that timed
        out): offer every block again (a disk tier skips those it still holds)."""
        if self.store.failure_count() != self._failures:
            self._failures = self.store.failure_count()
            self._known.clear()

    # ---- reads: started when a request is queued, used on admission ------------------------------
    def lookup(self, request_id: Hashable, digests: list[bytes], held: int, wake: Callable[[], None]) -> None:
        """Start reading the blocks after the first `held` of a prompt's `digests` (those the pool
        holds), at most `max_blocks`, off the step; wake() when the answer comes. No read (the
        request's earlier one let go of) when there is nothing to read or the store may not be
        asked now (`warming`)."""
        read = None if self._paused else self._start_read(request_id, digests, held)
        if read is None:
            self.finished([request_id])
        else:
            read.pending.future.add_done_callback(lambda _: wake())

    def _start_read(self, request_id: Hashable, digests: list[bytes], held: int) -> StoreRead | None:
        """The read of `digests` after the first `held`, or None: nothing to read, the store
        refused, or the reads not yet used (the request's earlier one among them) would hold
        more than one pool's worth of blocks in memory."""
        wanted = digests[held : held + self.max_blocks]
        keys = [block_key(self.space, digest) for digest in wanted]
        with self._reading:
            unused = sum(len(read.digests) for read in self._reads.values())
            if not wanted or unused + len(wanted) > self.max_blocks:
                return None
            pending = self.store.start_read(keys, self.layout.value_bytes)
            if pending is None:
                return None
            read = StoreRead(held, wanted, pending, digests)
            self._reads[request_id] = read  # (replacing its earlier one; counted from now)
            return read

    def ready(self, request_id: Hashable, held: Callable[[], int], wake: Callable[[], None]) -> bool:
        """Whether the request may be admitted: its read (if any) answered or timed out, and it
        still follows the `held()` blocks the pool holds (after blocks it started from were
        evicted, a new read starts, and the request waits for it)."""
        read = self._reads.get(request_id)
        if read is None:
            return True
        if not read.ready():
            return False
        if read.pending.values() is None or read.start <= held():
            return True  # (no answer: admitted without the store)
        self.lookup(request_id, read.prompt, held(), wake)
        return request_id not in self._reads

    def wait(self, request_id: Hashable, timeout_s: float) -> None:
        """Block until the request's read is answered, `timeout_s` at most."""
        read = self._reads.get(request_id)
        if read is not None:
            read.pending.wait(timeout_s)

    def matched(self, request_id: Hashable) -> int:
        """The prompt tokens the request's read brought (whole blocks; 0: none or no answer)."""
        read = self._reads.get(request_id)
        values = None if read is None else read.pending.values()
        return len(values or ()) * self.block_size

    def admit(self, request_id: Hashable) -> int:
        """`matched`; a read that brought nothing is let go of (what it missed offered again)."""
        tokens = self.matched(request_id)
        read = self._reads.get(request_id)
        if not tokens and read is not None:
            self._note_missing(read)
            self.finished([request_id])
        return tokens

    def finished(self, request_ids) -> None:
        """These requests let go of their reads."""
        with self._reading:
            for request_id in request_ids:
                self._reads.pop(request_id, None)

    def pin(self, digests: list[bytes]) -> None:
        """Keep these blocks last when a tier evicts (the disk's; others keep what they keep)."""
        self.store.pin([block_key(self.space, digest) for digest in digests])

    def unpin(self, digests: list[bytes]) -> None:
        """Undo one `pin` of these blocks."""
        self.store.unpin([block_key(self.space, digest) for digest in digests])

    def reads_on_their_way(self) -> int:
        """Reads started for requests that still hold them, whose answer has not come yet."""
        with self._reading:
            return sum(not read.pending.future.done() for read in self._reads.values())

    def load(self, request_id: Hashable, cache: PagedCache, row: int, attached: int, end: int) -> int:
        """Append to row `row` (holding `attached` tokens) the blocks the request's read brought
        that follow, up to position `end` (the chunk its step may fill); the tokens added (0 when
        none, the row does not end on a block boundary, the store did not answer, or the pool no
        longer holds what the read followed). The read is let go of once its blocks are used up,
        or when they ended short of `end`'s whole blocks."""
        read = self._reads.get(request_id)
        if read is None or attached % cache.block_size:
            return 0
        loaded = self._load_read(cache, row, attached, end, read)
        size = cache.block_size
        if attached + loaded < end // size * size or attached + loaded >= read.end * size:
            self.finished([request_id])
        return loaded

    def _load_read(self, pool: PagedCache, row: int, attached: int, end: int, read: StoreRead) -> int:
        """`load`'s work for `read`: the tokens added to the row."""
        size = pool.block_size
        values = read.pending.values()
        if values is None:  # no answer: nothing learned about what it holds
            return 0
        self._note_missing(read)
        skip = attached // size - read.start  # < 0: the pool lost blocks the read's run follows
        digests = read.digests[skip : end // size - read.start] if skip >= 0 else []
        loaded = 0
        deadline = time.monotonic() + self.store.timeout_s  # one for the whole load, not one a block
        for digest, value in zip(digests, values[skip:]):
            block = self._decoded(digest, value, deadline)
            if block is None:
                break
            try:  # block by block, from the bytes read straight into the pool (no stacked copy)
                pool.append_to_row(row, list(block[0].to(pool.device)), list(block[1].to(pool.device)))
            except OutOfBlocksError:
                break  # no room now: the rest are computed instead
            self._remember(digest)
            loaded += 1
        self.store.counters.hit_blocks += loaded
        return loaded * size

    def _note_missing(self, read: StoreRead) -> None:
        """Once `read` is answered: the blocks it asked for and did not get (evicted, flushed) are
        forgotten as written, so they are offered again."""
        values = read.pending.values()
        if values is None or read.missing_forgotten:
            return
        read.missing_forgotten = True
        for digest in read.digests[len(values) :]:
            self._known.pop(digest, None)

    def _decoded(self, digest: bytes, value, deadline: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, values) (layers, block_size, H_kv, D) of a block read back, or None when it
        fails a check: counted, deleted where the tier can, logged once, recomputed. A value whose
        bytes are read now (`disk_store.DiskBlock`) is read by the load's `deadline`."""
        data = value if isinstance(value, bytes | bytearray | memoryview) else value.read(deadline)
        if data is None:  # not read (gone, another size, no answer in time): the tier counted why
            self._known.pop(digest, None)
            return None
        try:
            return decode_block(self.layout, self.space, digest, data)
        except InvalidBlock as error:
            self.store.counters.invalid_blocks += 1
            self.store.discard(block_key(self.space, digest))  # (a tier that can, deletes it)
            self._known.pop(digest, None)  # recomputed, then written again
            if not self._warned_invalid:
                self._warned_invalid = True
                log.warning("KV store block %s refused (%s); it is recomputed", digest.hex(), error)
            return None

    # ---- the tiers' KV events ---------------------------------------------------------------------
    def listen(self, events) -> None:
        """Publish to `events` (a `KVEventPublisher`) the blocks the store's tiers write
        (BlockStored: a demotion, or a block a lower tier's read promoted into a higher one) and
        evict or delete (BlockRemoved), each in its tier's medium, as their threads report them."""
        self._events = events
        self.store.listen(self)

    def _digests(self, keys: list[str]) -> list[bytes]:
        """The digests of `keys` in this model's space (others are no block of ours)."""
        prefix, digests = f"kvcache:{self.space}:", []
        for key in keys:
            if key.startswith(prefix):
                with contextlib.suppress(ValueError):
                    digests.append(bytes.fromhex(key[len(prefix) :]))
        return digests

    def tier_stored(self, medium: str, keys: list[str]) -> None:
        """(a tier's thread) BlockStored in `medium`: one event a block this replica wrote, with
        its parent and tokens; one event for the rest, with no parent and no tokens (as vLLM's
        offloading connector publishes its blocks)."""
        unknown = []
        for digest in self._digests(keys):
            lineage = self._lineage.get(digest)
            if lineage is None:
                unknown.append(digest)
            else:
                self._events.stored([digest], *lineage, medium=medium)
        if unknown:
            self._events.stored(unknown, None, [], medium=medium)
        self._events.flush()

    def tier_removed(self, medium: str, keys: list[str]) -> None:
        """(a tier's thread) BlockRemoved in `medium`."""
        for digest in self._digests(keys):
            self._events.removed(digest, medium=medium)
        self._events.flush()

    def _note_lineage(self, digest: bytes, parent: bytes | None, tokens: list[int]) -> None:
        """Keep what a tier's BlockStored says of a block this replica writes (while events are on)."""
        if self._events is not None:
            self._lineage[digest] = (parent, tokens)
            if len(self._lineage) > _KNOWN:
                self._lineage.popitem(last=False)

    # ---- writes: after each step ------------------------------------------------------------------
    def close(self) -> None:
        """Close the store (its queued writes are dropped)."""
        self.store.close()

    def save(self, pool: PagedCache) -> None:
        """Queue every full block of `pool`'s rows that the store has not seen (copies taken now;
        encoded and written on the store's writer thread); nothing while `warming`."""
        if self._paused:
            return
        self._check_restart()
        if not self.store.writable():
            return  # not remembered: offered again once the store takes writes again
        size = pool.block_size
        for seq in pool.rows:
            state = pool.allocators[0].sequence(seq)
            new = [index for index, digest in enumerate(state.hashes)
                   if digest not in self._known and _held_by_every_group(pool, seq, index)]
            if not new:
                continue
            where = [  # per group (full layers, each window's): the new blocks' slots
                torch.tensor([slot for i in new for slot in allocator.slots(seq, i * size, (i + 1) * size)],
                             dtype=torch.long, device=pool.device)
                for allocator in pool.allocators
            ]
            read = [layer.read_slots(where[layer.group]) for layer in pool.layers]  # per layer (n·S, H_kv, D)
            keys = torch.stack([k for k, _ in read]).to("cpu")  # (layers, n·S, H_kv, D)
            values = torch.stack([v for _, v in read]).to("cpu")
            for position, index in enumerate(new):
                digest = state.hashes[index]
                rows = slice(position * size, (position + 1) * size)
                block_keys, block_values = keys[:, rows], values[:, rows]

                def make(digest=digest, block_keys=block_keys, block_values=block_values) -> bytes:
                    return encode_block(self.layout, self.space, digest, block_keys, block_values)

                tokens = state.token_ids[index * size : (index + 1) * size]
                self._note_lineage(digest, state.hashes[index - 1] if index else None, list(tokens))
                self.store.put(block_key(self.space, digest), make)
                self._remember(digest)


def _held_by_every_group(pool: PagedCache, seq, index: int) -> bool:
    """Whether block `index` of `seq` still holds every layer's keys (a sliding-window group gives
    back the blocks its window has passed: those are never offered, since a value holds all
    layers)."""
    return all(allocator.sequence(seq).table[index] != HOLE for allocator in pool.allocators)
