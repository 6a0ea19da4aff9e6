"""PagedCache: keys and values in fixed-size blocks of one pool, shared between sequences.

Each layer stores (num_blocks, block_size, H_kv, D); a `BlockAllocator` (plain Python) says
which blocks each sequence (batch row) owns. Token p of a row lives in slot
`table[p // block_size] * block_size + p % block_size`. `update` writes the new rows to their
slots and gathers each row's visible keys and values (whole blocks, right-padded to the
longest row), with a mask that hides the padding. Rows may hold different numbers of tokens:
padding columns of an HF-style attention_mask are not stored at all, so a row's token p always
sits at position p, and a prompt prefix cached in full blocks can be attached to a new row
instead of recomputed.

The gather copies every visible block once per layer and step (what a paged attention kernel
avoids by reading the blocks in place); a single row whose blocks are consecutive in the pool
(a fresh pool hands them out in order) is returned as a view, without a copy.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from itertools import count

import torch

from .base import Cache, LayerMasks
from .blocks import BlockAllocator, OutOfBlocksError
from .checks import check_batch_index, check_crop, check_kv_pair, check_new_tokens, where
from .config import read_cache_geometry
from .errors import CacheConfigError, CacheDeviceError, CacheDtypeError, CacheShapeError
from .layer import CacheLayer
from .paged_storage import Step, gather_rows, write_and_gather

__all__ = ["OutOfBlocksError", "PagedCache", "PagedLayer"]


class PagedLayer(CacheLayer):
    """One layer's block storage (num_blocks, block_size, H_kv, D); the owning `PagedCache`
    decides where rows go, so a layer is only usable inside its cache."""

    def __init__(self, cache: PagedCache) -> None:
        super().__init__()
        self._cache = cache
        self._columns = 0  # columns of the batch timeline this layer has seen
        self._last_step = -1

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D); return K, V (B, H_kv, T_kv, D), rows right-padded."""
        return self._cache._update_layer(self, k, v)

    def get_seq_length(self) -> int:
        """Columns of the batch timeline seen (padding columns included, as in attention_mask)."""
        return self._columns

    def mask_key(self, new_tokens: int) -> Hashable:
        """Unused: `PagedCache.attention_masks` builds one mask for every layer itself."""
        return ("paged", self._cache._step_counter, new_tokens)

    def mask_positions(self, new_tokens, device):
        """Causal positions, for rows of equal length only (else the mask is per row)."""
        past = self._cache._equal_length("mask_positions")
        key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past:], key_positions

    @property
    def batch_size(self) -> int | None:
        return len(self._cache.rows) or None

    @property
    def keys(self) -> torch.Tensor | None:
        """Each row's keys (B, H_kv, T, D) gathered from its blocks, right-padded with zeros."""
        return self._cache._gather_now(self._keys)

    @property
    def values(self) -> torch.Tensor | None:
        """Each row's values (B, H_kv, T, D_v) gathered from its blocks, right-padded with zeros."""
        return self._cache._gather_now(self._values)

    def _rows_held(self) -> int:
        return self._cache.allocator.num_in_use * self._cache.block_size

    @property
    def nbytes_used(self) -> int:
        """Bytes of the blocks in use (whole blocks: a partial last block counts in full)."""
        if self._keys is None or self._values is None:
            return 0
        slots = self._keys.shape[0] * self._keys.shape[1]
        return self._rows_held() * ((self._keys.nbytes + self._values.nbytes) // slots)

    def crop(self, max_length: int) -> None:
        """Rows are shared by every layer: crops the whole cache."""
        self._cache.crop(max_length)

    def reset(self) -> None:
        """Rows are shared by every layer: resets the whole cache."""
        self._cache.reset()


class PagedCache(Cache):
    """A cache of `num_blocks` blocks of `block_size` tokens shared by its rows (sequences).

    Plugs into the model like any cache: an empty PagedCache given to `generate` makes one row
    per batch row. To reuse cached prompt prefixes, add rows yourself with `add_sequence`
    (see `kvcache.prefix`), then run only the tokens that were not attached.

    Args:
        num_blocks: blocks in the pool (each layer stores num_blocks × block_size rows).
        block_size: tokens per block.
        config: model config (object or dict) giving num_hidden_layers, num_key_value_heads,
            head_dim; every layer must be full attention.
        num_layers, kv_heads, head_dim: explicit sizes, merged with the config.
        dtype, device: storage is allocated now when heads, dim and dtype are known, else by
            the first update (with k's dtype and device).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        config: object = None,
        num_layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        geometry = read_cache_geometry(config, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim)
        if geometry.num_layers is None:
            raise CacheConfigError("PagedCache needs the layer count: pass num_layers= or config=")
        if geometry.layer_kinds is not None and "sliding" in geometry.layer_kinds:
            raise CacheConfigError(
                "PagedCache holds full-attention layers only; this config has sliding-window "
                "layers (use the dynamic or sliding cache for it)"
            )
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.rows: list[int] = []  # allocator sequence id of each batch row
        self._seq_ids = count()
        self._step: Step | None = None
        self._step_counter = 0
        super().__init__([PagedLayer(self) for _ in range(geometry.num_layers)], device=device)
        if geometry.kv_heads and geometry.head_dim and dtype is not None:
            shape = (num_blocks, block_size, geometry.kv_heads, geometry.head_dim)
            for layer in self.layers:
                self._allocate(layer, shape, shape, dtype, self._device or torch.device("cpu"))

    # ---- pool ----------------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def row_lengths(self) -> list[int]:
        """Tokens stored per row (padding excluded)."""
        return [self.allocator.sequence(seq).num_tokens for seq in self.rows]

    @staticmethod
    def _allocate(layer: CacheLayer, key_shape, value_shape, dtype, device) -> None:
        # zeros, not empty: gathered padding slots are masked, but a masked NaN still poisons
        # SDPA (0 · NaN), so storage must never hold non-finite garbage
        layer._keys = torch.zeros(key_shape, dtype=dtype, device=device)  # (N, S, H_kv, D)
        layer._values = torch.zeros(value_shape, dtype=dtype, device=device)  # (N, S, H_kv, D_v)

    def _storage_device(self, fallback: torch.device | None = None) -> torch.device:
        keys = self.layers[0]._keys
        if keys is not None:
            return keys.device
        return fallback or self._device or torch.device("cpu")

    # ---- rows ----------------------------------------------------------------------------------
    def add_sequence(self, token_ids: Sequence[int] = (), *, reuse_prefix: bool = True) -> int:
        """Add a row, declaring its first `token_ids`; return how many were attached from cache.

        The attached tokens (whole cached blocks matching the start of token_ids, at most
        len(token_ids) - 1) need no forward: run token_ids[attached:] through the model.
        """
        seq = next(self._seq_ids)
        attached = self.allocator.add_sequence(seq, token_ids, reuse_prefix=reuse_prefix)
        self.rows.append(seq)
        self._set_columns(max(self.get_seq_length(), attached))
        return attached

    def declare_tokens(self, row: int, token_ids: Sequence[int], start: int | None = None) -> None:
        """Tell the cache the token ids of row `row`'s positions start, start+1, … (default:
        after those already declared), e.g. generated tokens, so its full blocks become
        findable by later prompts that start the same way. Declare only the tokens actually
        run (or to be run) through the model at those positions."""
        self.allocator.declare_tokens(self._row_seq(row), token_ids, start)

    def token_ids(self, row: int) -> list[int]:
        """The token ids declared for row `row` (may run ahead of the positions stored)."""
        return list(self.allocator.sequence(self._row_seq(row)).token_ids)

    def fork(self, row: int) -> int:
        """Add a row that shares row `row`'s blocks (copied on write); return its index."""
        seq = next(self._seq_ids)
        self.allocator.fork(self._row_seq(row), seq)
        self.rows.append(seq)
        return len(self.rows) - 1

    def _row_seq(self, row: int) -> int:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self.rows):
            raise CacheShapeError(f"row must be in [0, {len(self.rows)}), got {row!r}")
        return self.rows[row]

    def _set_columns(self, columns: int) -> None:
        for layer in self.layers:
            layer._columns = columns

    def _equal_length(self, what: str) -> int:
        lengths = set(self.row_lengths)
        columns = self.get_seq_length()
        if lengths and lengths != {columns}:
            raise CacheShapeError(
                f"{what}: rows hold different token counts {self.row_lengths} over "
                f"{columns} columns; pass an attention_mask (1 = token) so each row's "
                f"positions are counted from its own tokens"
            )
        return columns

    # ---- the seam --------------------------------------------------------------------------------
    def positions(self, new_tokens, layer_idx=0, *, device=None) -> torch.Tensor:
        """Positions past .. past + new_tokens - 1 (T_new,); rows must hold equal lengths."""
        check_new_tokens(new_tokens)
        past = self._equal_length("positions")
        return torch.arange(past, past + new_tokens, device=device or self._storage_device())

    def attention_masks(self, new_tokens, attention_mask=None, *, device=None) -> list[torch.Tensor]:
        """One mask (B or 1, 1, T_new, T_kv) for every layer; also reserves this forward's blocks
        (raising `OutOfBlocksError` before anything is written).

        attention_mask: optional (B, columns + T_new), 1 = token, 0 = padding (not stored).
        """
        check_new_tokens(new_tokens)
        fallback = attention_mask.device if attention_mask is not None else (
            torch.device(device) if device is not None else None
        )
        where_ = self._storage_device(fallback)
        batch = attention_mask.shape[0] if attention_mask is not None and attention_mask.dim() == 2 \
            else (len(self.rows) or None)
        if batch is None:  # rows are made by the first update, which gives the batch size
            self._step = None
            positions = torch.arange(new_tokens, device=where_)  # (T_new,)
            mask = positions[None, :] <= positions[:, None]  # (T_new, T_new)
            return LayerMasks([mask[None, None]] * len(self.layers))  # (1, 1, T_new, T_new)
        step, mask = self._begin(new_tokens, attention_mask, batch, where_)
        self._step = step
        return LayerMasks([mask] * len(self.layers))

    def _begin(
        self, new_tokens: int, attention_mask: torch.Tensor | None, batch: int, device: torch.device
    ) -> tuple[Step, torch.Tensor]:
        """Reserve blocks for this forward and compute its slots and mask."""
        if not self.rows:
            for _ in range(batch):
                self.add_sequence()
        if batch != len(self.rows):
            raise CacheShapeError(f"the forward has batch {batch}; the cache holds {len(self.rows)} rows")
        lengths = self.row_lengths
        columns = self.get_seq_length()
        if attention_mask is None:
            self._equal_length("a forward without attention_mask")
            real = None
            counts = [new_tokens] * batch
        else:
            if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, columns + new_tokens):
                raise CacheShapeError(
                    f"attention_mask must be (batch, columns + new_tokens) = "
                    f"({batch}, {columns + new_tokens}), got shape {tuple(attention_mask.shape)}"
                )
            given = attention_mask.to(device=device, dtype=torch.bool)
            held = given[:, :columns].sum(1).tolist()
            if held != lengths:
                raise CacheShapeError(
                    f"attention_mask counts {held} earlier tokens per row; the cache holds "
                    f"{lengths}: the mask must describe the tokens the cache holds"
                )
            real = given[:, columns:]  # (B, T_new)
            counts = real.sum(1).tolist()
            if all(c == new_tokens for c in counts):
                real = None
        totals = [held + new for held, new in zip(lengths, counts)]
        copies = self.allocator.reserve(self.rows, totals)
        for source, target in copies:  # a shared partial block is copied before it is written
            for layer in self.layers:
                for storage in (layer._keys, layer._values):
                    if storage is not None:
                        storage[target].copy_(storage[source])
        visible = max(1, *totals)  # at least one key (masked) even if every row is padding so far
        size = self.block_size
        width = -(-visible // size)  # blocks per row in the gather
        tables = [self.allocator.sequence(seq).table[:width] for seq in self.rows]
        first_block = None
        if batch == 1 and len(tables[0]) == width and tables[0] == list(
            range(tables[0][0], tables[0][0] + width)
        ):
            first_block, read_blocks = tables[0][0], None
        else:  # rows shorter than the longest repeat a block of theirs, or block 0 (masked)
            padded = [
                block for table in tables for block in table + (table or [0])[:1] * (width - len(table))
            ]
            read_blocks = torch.tensor(padded, dtype=torch.long, device=device)  # (B·n,)
        write = [
            slot for seq, held, total in zip(self.rows, lengths, totals)
            for slot in self.allocator.slots(seq, held, total)
        ]
        write_slots = torch.tensor(write, dtype=torch.long, device=device)  # (N_real,)
        key_positions = torch.arange(visible, device=device)  # (T_kv,)
        past = torch.tensor(lengths, device=device)[:, None]  # (B, 1)
        if real is None:
            source_rows = None
            query = past + torch.arange(new_tokens, device=device)  # (B, T_new)
        else:
            source_rows = real.flatten().nonzero().squeeze(1)  # (N_real,) row-major, as write
            query = (past + real.long().cumsum(1) - 1).masked_fill(~real, -1)  # (B, T_new)
        if real is None and len(set(lengths)) == 1 and new_tokens == 1:  # decode: every key
            mask = torch.ones((1, 1, 1, visible), dtype=torch.bool, device=device)  # (1, 1, 1, T_kv)
        elif real is None and len(set(lengths)) == 1:
            mask = (key_positions[None, :] <= query[0][:, None])[None, None]  # (1, 1, T_new, T_kv)
        else:
            allowed = key_positions[None, None, :] <= query[:, :, None]  # (B, T_new, T_kv)
            # a padding query sees key 0 of its row, so no row of the mask is empty (no NaN)
            allowed |= (query[:, :, None] < 0) & (key_positions == 0)
            mask = allowed[:, None]  # (B, 1, T_new, T_kv)
        self._step_counter += 1
        step = Step(
            self._step_counter, new_tokens, batch, totals, write_slots, source_rows,
            read_blocks, first_block, visible,
        )
        return step, mask

    def _update_layer(
        self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check(layer, k, v)
        batch, heads, new_tokens, _ = k.shape
        step = self._step
        if layer.layer_idx == 0:
            if step is not None and step.pending and (step.new_tokens, step.batch) != (new_tokens, batch):
                raise CacheShapeError(
                    f"attention_masks was asked for {step.new_tokens} tokens of batch {step.batch}; "
                    f"update got {new_tokens} tokens of batch {batch}"
                )
            if step is None or not step.pending:  # used directly: a forward without padding
                step, _ = self._begin(new_tokens, None, batch, self._storage_device(k.device))
                self._step = step
            step.pending = False
            for seq, total in zip(self.rows, step.totals):
                self.allocator.commit(seq, total)
        elif step is None or step.pending or layer._last_step == step.step_id:
            raise CacheShapeError(
                f"layer {layer.layer_idx} updated before layer 0 in this forward: update the layers "
                f"in order 0, 1, …, once each"
            )
        elif (step.new_tokens, step.batch) != (new_tokens, batch):
            raise CacheShapeError(
                f"k{where(layer.layer_idx)} has {new_tokens} tokens of batch {batch}; layer 0 "
                f"stored {step.new_tokens} tokens of batch {step.batch} in this forward"
            )
        layer._last_step = step.step_id
        layer._columns += new_tokens
        keys_out = write_and_gather(layer._keys, k, step)
        values_out = write_and_gather(layer._values, v, step)
        return keys_out, values_out

    def _check(self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor) -> None:
        stored_k, stored_v = layer._keys, layer._values
        if stored_k is not None and stored_v is not None and type(k) is type(v) is torch.Tensor:
            # fast path of the decode loop: one pass of comparisons, no messages built
            ks, vs, sk = k.shape, v.shape, stored_k.shape
            if (
                len(ks) == 4
                and len(vs) == 4
                and ks[:3] == vs[:3]
                and ks[2] >= 1
                and ks[1] == sk[2]
                and ks[3] == sk[3]
                and vs[3] == stored_v.shape[3]
                and k.dtype == v.dtype == stored_k.dtype
                and k.device == v.device == stored_k.device
            ):
                return
        check_kv_pair(k, v, layer.layer_idx)
        if layer._keys is None:
            shape = (self.num_blocks, self.block_size, k.shape[1])
            self._allocate(layer, (*shape, k.shape[3]), (*shape, v.shape[3]), k.dtype, k.device)
        stored_k, stored_v = layer._keys, layer._values
        assert stored_k is not None and stored_v is not None
        place = where(layer.layer_idx)
        if (k.shape[1], k.shape[3], v.shape[3]) != (stored_k.shape[2], stored_k.shape[3], stored_v.shape[3]):
            raise CacheShapeError(
                f"k, v{place} have {k.shape[1]} kv heads and head dims {k.shape[3]}, {v.shape[3]}; "
                f"the cache stores {stored_k.shape[2]} heads of dims {stored_k.shape[3]}, "
                f"{stored_v.shape[3]}"
            )
        if k.dtype != stored_k.dtype:
            raise CacheDtypeError(f"k, v{place} have dtype {k.dtype}; the cache stores {stored_k.dtype}")
        if k.device != stored_k.device:
            raise CacheDeviceError(f"k, v{place} are on {k.device}; the cache is on {stored_k.device}")

    def _gather_now(self, storage: torch.Tensor | None) -> torch.Tensor | None:
        if storage is None or not self.rows:
            return None
        lengths = self.row_lengths
        visible = max(lengths)
        if visible == 0:
            return None
        slots = [self.allocator.slots(seq, 0, length) for seq, length in zip(self.rows, lengths)]
        return gather_rows(storage, slots)

    # ---- whole-cache operations ----------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` columns: a row padded on the left by p columns keeps
        max_length - p tokens; blocks past the end lose a reference."""
        check_crop(max_length)
        columns = self.get_seq_length()
        if max_length >= columns:
            return
        for seq, length in zip(self.rows, self.row_lengths):
            keep = max(0, min(length, max_length - (columns - length)))
            self.allocator.truncate(seq, keep)
        self._set_columns(max_length)
        self._step = None

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` in that order; a repeated row is forked (blocks shared)."""
        index = check_batch_index(indices, len(self.rows), torch.device("cpu")).tolist()
        kept: list[int] = []
        used: set[int] = set()
        for row in index:
            seq = self.rows[row]
            if seq in used:
                child = next(self._seq_ids)
                self.allocator.fork(seq, child)
                kept.append(child)
            else:
                used.add(seq)
                kept.append(seq)
        for seq in self.rows:
            if seq not in used:
                self.allocator.free_sequence(seq)
        self.rows = kept
        self._step = None

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times (forks that share blocks)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheShapeError(f"repeats must be an int >= 1, got {repeats!r}")
        self.select([row for row in range(len(self.rows)) for _ in range(repeats)])

    def free_rows(self) -> None:
        """Release every row; hashed full blocks stay cached for later prompts (see reset)."""
        for seq in self.rows:
            self.allocator.free_sequence(seq)
        self.rows = []
        self._set_columns(0)
        self._step = None

    def reset(self) -> None:
        """Forget every row; full blocks with known token ids stay findable by prefix."""
        self.free_rows()

    @property
    def nbytes_used(self) -> int:
        """Bytes of the blocks in use over all layers (whole blocks)."""
        return sum(layer.nbytes_used for layer in self.layers)

    def __repr__(self) -> str:
        pool = self.allocator
        return (
            f"PagedCache({len(self.layers)} layers, {pool.num_blocks} blocks of {pool.block_size}, "
            f"rows={self.row_lengths}, in use {pool.num_in_use}, cached {pool.num_cached}, "
            f"free {pool.num_free})"
        )
