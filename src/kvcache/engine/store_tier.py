"""The engine's second tier of prefix blocks: a block store shared by replicas (`RedisBlockStore`).

When a prompt's chunk is about to be prefilled, its full blocks that the pool could not attach
are looked up in the store (the longest run within the chunk, in two round trips), checked, and
written into the request's row as if a forward had computed them; prefill then runs only the
rest. After each step, full blocks of the
running rows that the store has not seen are copied out and queued for the background writer.
The pool stays the first tier: what it holds is never fetched.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from kvcache.cache import OutOfBlocksError, PagedCache
from kvcache.engine.block_codec import (
    InvalidBlock,
    block_key,
    decode_block,
    encode_block,
    layout_of,
    namespace,
)
from kvcache.generation.params import RequestError

log = logging.getLogger("kvcache.store")
_KNOWN = 1 << 16  # digests remembered as stored (written or read back), least recent forgotten first


class StoreTier:
    """Shares `pool`'s full prefix blocks of `model` through `store` (see the module docstring)."""

    def __init__(self, store, model, pool: PagedCache) -> None:
        if len(pool.allocators) != 1 or pool.full_allocator is None:
            raise RequestError(
                "a KV store shares the blocks of full-attention models; this model has sliding-window "
                "layers, whose rows hold only their window"
            )
        self.store = store
        self.layout = layout_of(model, pool.block_size)
        self.space = namespace(model, self.layout)
        self._known: OrderedDict[bytes, None] = OrderedDict()
        self._outages = store.counters.outages
        self._warned_invalid = False

    def _remember(self, digest: bytes) -> None:
        self._known[digest] = None
        self._known.move_to_end(digest)
        if len(self._known) > _KNOWN:
            self._known.popitem(last=False)

    def _check_restart(self) -> None:
        """After an outage the store may have restarted empty: offer every block again."""
        if self.store.counters.outages != self._outages:
            self._outages = self.store.counters.outages
            self._known.clear()

    # ---- reads: on admission ----------------------------------------------------------------------
    def load(self, pool: PagedCache, row: int, tokens: list[int], attached: int, end: int) -> int:
        """Append to row `row` (holding `attached` tokens of `tokens`) the next full blocks of
        `tokens` the store holds, up to position `end` (the chunk its step may fill); the tokens
        added (0 when none, or the store fails)."""
        size = pool.block_size
        if attached % size:
            raise ValueError(f"store blocks start on block boundaries; the row holds {attached} tokens")
        wanted = pool.prefix_digests(tokens)[attached // size : end // size]
        if not wanted or not self.store.available():
            return 0
        self.store.counters.lookups += 1
        keys_wanted = [block_key(self.space, digest) for digest in wanted]
        values = self.store.fetch_run(keys_wanted, self.layout.value_bytes)
        if values is None:  # no answer: nothing learned about what it holds
            return 0
        for digest in wanted[len(values) :]:  # not there (evicted, flushed): offered again
            self._known.pop(digest, None)
        keys, vals = [], []
        for digest, value in zip(wanted, values):
            try:
                block_keys, block_values = decode_block(self.layout, self.space, digest, value)
            except InvalidBlock as error:
                self.store.counters.invalid_blocks += 1
                if not self._warned_invalid:
                    self._warned_invalid = True
                    log.warning("KV store block %s refused (%s); it is recomputed", digest.hex(), error)
                break
            keys.append(block_keys)
            vals.append(block_values)
        if not keys:
            return 0
        device = pool.device
        stacked_keys = torch.cat(keys, dim=1).to(device)  # (layers, n·S, H_kv, D)
        stacked_values = torch.cat(vals, dim=1).to(device)  # (layers, n·S, H_kv, D_v)
        try:
            pool.append_to_row(row, list(stacked_keys), list(stacked_values))
        except OutOfBlocksError:
            return 0  # no room now: the blocks are computed instead
        self.store.counters.hit_blocks += len(keys)
        for digest in wanted[: len(keys)]:
            self._remember(digest)
        return len(keys) * size

    # ---- writes: after each step ------------------------------------------------------------------
    def offer(self, pool: PagedCache) -> None:
        """Queue every full block of `pool`'s rows that the store has not seen (copies taken now;
        encoded and written on the store's writer thread)."""
        self._check_restart()
        if not self.store.available():
            return  # not remembered: offered again once the store is back
        allocator, size = pool.allocator, pool.block_size
        for seq in pool.rows:
            state = allocator.sequence(seq)
            new = [index for index, digest in enumerate(state.hashes) if digest not in self._known]
            if not new:
                continue
            slots = [slot for index in new for slot in allocator.slots(seq, index * size, (index + 1) * size)]
            where = torch.tensor(slots, dtype=torch.long, device=pool.device)
            read = [layer.read_slots(where) for layer in pool.layers]  # per layer (n·S, H_kv, D)
            keys = torch.stack([k for k, _ in read]).to("cpu")  # (layers, n·S, H_kv, D)
            values = torch.stack([v for _, v in read]).to("cpu")
            for position, index in enumerate(new):
                digest = state.hashes[index]
                rows = slice(position * size, (position + 1) * size)
                block_keys, block_values = keys[:, rows], values[:, rows]

                def make(digest=digest, block_keys=block_keys, block_values=block_values) -> bytes:
                    return encode_block(self.layout, self.space, digest, block_keys, block_values)

                self.store.put(block_key(self.space, digest), make)
                self._remember(digest)


def open_store(store, **options):
    """A store object as given, or a `RedisBlockStore(url, **options)` for a redis:// (rediss://,
    unix://) URL; RequestError for any other string."""
    if not isinstance(store, str):
        return store
    if not store.startswith(("redis://", "rediss://", "unix://")):
        raise RequestError(f"kv_store must be a redis://HOST:PORT/DB URL, got {store!r}")
    from kvcache.engine.redis_store import RedisBlockStore

    return RedisBlockStore(store, **options)
