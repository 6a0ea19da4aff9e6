"""PagedLayer: one layer's block storage of a PagedCache, (num_blocks, block_size, H_kv, D) for
keys and for values, or (…, width) in the row format of the cache's kv_dtype (`formats`). The
owning cache decides where rows go (block tables, the forward's `Step`); the layer allocates,
checks, writes and reads its own tensors."""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvcache.blocks.allocator import HOLE

from ..checks import check_kv_pair, where
from ..errors import CacheDeviceError, CacheDtypeError, CacheShapeError
from ..layer import CacheLayer, normal_tensors
from .formats import RowFormat, row_formats
from .recent import put_exact_rows
from .storage import Step, gather_rows, write_and_gather


class PagedLayer(CacheLayer):
    """One layer of a PagedCache; only usable inside its cache (`cache`: the PagedCache)."""

    def __init__(self, cache, group: int = 0) -> None:
        super().__init__()
        self._cache = cache
        self.group = group  # which of the cache's block tables (full or windowed) it follows
        self.formats: tuple[RowFormat, RowFormat] | None = None  # keys', values' (with a kv_dtype)
        self.forward_dtype: torch.dtype | None = None  # what such a layer's reads return
        self.columns = 0  # columns of the batch timeline this layer has seen (the cache sets it)
        self.last_step = -1  # the id of the forward step that wrote this layer last

    # ---- the seam --------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D); return K, V (B, H_kv, T_kv, D), rows right-padded."""
        return self._cache.update_layer(self, k, v)

    def get_seq_length(self) -> int:
        """Columns of the batch timeline seen (padding columns included, as in attention_mask)."""
        return self.columns

    def mask_key(self, new_tokens: int) -> Hashable:
        """The group's window, the rows' lengths and the chunk length determine the layout."""
        return ("paged", self.window, tuple(self._cache.row_lengths), self.columns, new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of a forward without padding, every row holding the same tokens (the
        cache's own `begin` plans every other case): queries at past..past+T_new-1 (T_new,);
        keys at each row's gathered positions, from 0 (full attention) or from the first block
        the earliest query's window reaches (T_kv,). Raises `CacheShapeError` for rows of
        different lengths (they have no common positions)."""
        past = self.columns
        lengths = [self.allocator.sequence(seq).num_tokens for seq in self._cache.rows]
        # the group's first layer commits the forward's tokens: before it, past; after, past + T_new
        if len(set(lengths)) > 1 or not set(lengths) <= {past, past + new_tokens}:
            raise CacheShapeError(
                f"mask_positions: rows hold different token counts {lengths} over {past} columns; "
                f"rows of different lengths have no common positions (the cache's own begin, "
                f"given an attention_mask, plans such forwards)"
            )
        size, window = self._cache.block_size, self.window
        first = 0 if window is None else max(0, past - window + 1) // size * size
        key_positions = torch.arange(first, past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past - first :], key_positions

    @property
    def kv_dtype(self) -> str | None:
        """The cache's: "bfloat16", "int8", "int8/int4" … when rows are stored in a dtype of
        their own (`formats`); None: as the forward gives them."""
        return self._cache.kv_dtype

    # ---- storage ---------------------------------------------------------------------------
    @property
    def allocated(self) -> bool:
        """Whether the block storage exists (built with a dtype, or after the first update)."""
        return self._keys is not None

    def share_storage(self, other: PagedLayer) -> None:
        """Use `other`'s block storage (a view of the same pool: `PagedCache.view`)."""
        self._keys, self._values = other._keys, other._values
        self.formats, self.forward_dtype = other.formats, other.forward_dtype

    def allocate(self, key_shape: tuple, value_shape: tuple, dtype: torch.dtype, device) -> None:
        """Zeroed storage of (num_blocks, block_size, H_kv, D) keys and (…, D_v) values (with a
        kv_dtype: each side's row format, its width and storage dtype; dtype is then the
        forward's). Zeros, not empty: gathered padding slots are masked, but a masked NaN still
        poisons SDPA (0 · NaN), so storage must never hold non-finite garbage (packed zeros are
        scale 0, zero 0: the value 0)."""
        key_dtype = value_dtype = dtype
        if self.kv_dtype is not None:
            self.formats = keys, values = row_formats(self.kv_dtype, key_shape[-1], value_shape[-1])
            key_shape, value_shape = (*key_shape[:-1], keys.width), (*value_shape[:-1], values.width)
            self.forward_dtype, key_dtype, value_dtype = dtype, keys.storage_dtype, values.storage_dtype
        with normal_tensors():
            self._keys = torch.zeros(key_shape, dtype=key_dtype, device=device)  # (N, S, H_kv, D)
            self._values = torch.zeros(value_shape, dtype=value_dtype, device=device)  # (N, S, H_kv, D_v)

    def check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise a named error unless k, v (B, H_kv, T_new, D) fit the storage (allocated here,
        from k and v, on the first update)."""
        stored_k, stored_v = self._keys, self._values
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
        check_kv_pair(k, v, self.layer_idx)
        if self._keys is None:
            pool = (self.allocator.num_blocks, self._cache.block_size, k.shape[1])
            self.allocate((*pool, k.shape[3]), (*pool, v.shape[3]), k.dtype, k.device)
        assert self._keys is not None
        if self.formats is None:
            what = f"k, v{where(self.layer_idx)}"
            self.check_layout(k.shape[1], k.shape[3], v.shape[3], (k.dtype, v.dtype), what)
        elif (k.shape[1], k.shape[3], v.shape[3]) != (self._keys.shape[2], *(f.dim for f in self.formats)):
            raise CacheShapeError(
                f"k, v{where(self.layer_idx)} have {k.shape[1]} kv heads and head dims {k.shape[3]}, "
                f"{v.shape[3]}; the cache stores {self._keys.shape[2]} heads of dims "
                f"{self.formats[0].dim}, {self.formats[1].dim} as {self.kv_dtype}"
            )
        if k.device != self._keys.device:
            raise CacheDeviceError(
                f"k, v{where(self.layer_idx)} are on {k.device}; the cache is on {self._keys.device}"
            )

    def check_layout(
        self, kv_heads: int, head_dim: int, value_dim: int, dtypes: tuple[torch.dtype, torch.dtype], what: str
    ) -> None:
        """Raise CacheShapeError / CacheDtypeError unless rows of that layout, keys and values of
        `dtypes`, fit the storage (any layout fits before it is allocated)."""
        keys, values = self._keys, self._values
        if keys is None or values is None:
            return
        if (kv_heads, head_dim, value_dim) != (keys.shape[2], keys.shape[3], values.shape[3]):
            raise CacheShapeError(
                f"{what} have {kv_heads} kv heads and head dims {head_dim}, {value_dim}; the cache "
                f"stores {keys.shape[2]} heads of dims {keys.shape[3]}, {values.shape[3]}"
            )
        if dtypes != (keys.dtype, values.dtype):
            raise CacheDtypeError(f"{what} have dtypes {dtypes[0]}, {dtypes[1]}; the cache stores "
                                  f"{keys.dtype}, {values.dtype}")

    def write_and_gather(
        self, k: torch.Tensor, v: torch.Tensor, step: Step
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this forward's k, v to their slots; return every row's visible K, V."""
        assert self._keys is not None and self._values is not None
        self.last_step = step.step_id
        self.columns += k.shape[2]
        if self.formats is not None:  # in the kv_dtype on the way in, the forward's on the way out
            key_rows, value_rows = self.formats
            keys = write_and_gather(self._keys, key_rows.pack(k), step)
            values = write_and_gather(self._values, value_rows.pack(v), step)
            keys, values = key_rows.unpack(keys, k.dtype), value_rows.unpack(values, v.dtype)
            recent = self._cache.recent
            if recent is not None:
                copies = tuple(None if self._is_storage(t) else t for t in (keys, values))
                put_exact_rows(recent, self.layer_idx, self._cache.rows, step, (k, v), copies)
            return keys, values
        return (
            write_and_gather(self._keys, k, step),
            write_and_gather(self._values, v, step),
        )

    def _is_storage(self, rows: torch.Tensor) -> bool:
        """Whether gathered rows are a view of this layer's storage (a side stored in the forward's
        dtype, one row on consecutive blocks: exact already, and never to be written over)."""
        pointer = rows.untyped_storage().data_ptr()
        stored = (s for s in (self._keys, self._values) if s is not None)
        return any(s.untyped_storage().data_ptr() == pointer for s in stored)

    def storage_rows(self):
        """The layer's whole storage as numpy rows, views: keys (blocks·S·H_kv, D) and values
        (…, D_v), bfloat16 as its bits (uint16, `arrays`), packed rows as their bytes (uint8, or
        int8 for fp8: (…, width), `formats`); slot s's kv head h is row s·H_kv + h.
        None before it is allocated, off the CPU, or in a dtype numpy lacks (what a step that
        reads and writes the blocks in place needs)."""
        arrays = self._buffer_arrays()
        if arrays is None:
            return None
        keys, values = arrays
        return keys.reshape(-1, keys.shape[-1]), values.reshape(-1, values.shape[-1])

    def read_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (T, H_kv, D) and values (T, H_kv, D_v) at storage `slots` (T,), copies, as stored
        (in the kv_dtype's row format: (T, H_kv, width), `formats`)."""
        assert self._keys is not None and self._values is not None
        return tuple(  # type: ignore[return-value]
            storage.view(-1, *storage.shape[2:]).index_select(0, slots)
            for storage in (self._keys, self._values)
        )

    def write_slots(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write keys (T, H_kv, D) and values (T, H_kv, D_v) to storage `slots` (T,), as stored
        (in the kv_dtype's row format: what `read_slots` gave)."""
        assert self._keys is not None and self._values is not None
        for storage, rows in ((self._keys, keys), (self._values, values)):
            storage.view(-1, *storage.shape[2:]).index_copy_(0, slots, rows.to(storage.device))

    def copy_block(self, source: int, target: int) -> None:
        """Copy block `source` onto block `target` (copy on write of a shared partial block)."""
        for storage in (self._keys, self._values):
            if storage is not None:
                storage[target].copy_(storage[source])

    # ---- views and bookkeeping ---------------------------------------------------------------
    @property
    def allocator(self):
        """The block tables this layer follows (its group's)."""
        return self._cache.allocators[self.group]

    @property
    def window(self) -> int | None:
        return self.allocator.window

    @property
    def batch_size(self) -> int | None:
        return len(self._cache.rows) or None

    def _gather(self, storage: torch.Tensor | None) -> torch.Tensor | None:
        """Each row's rows of `storage` (B, H_kv, T, D), right-padded with zeros: every token, or a
        windowed layer's last `window` that its blocks still hold (the window's first block may
        be given back already: the next query needs only the last window - 1)."""
        cache = self._cache
        lengths = cache.row_lengths
        if storage is None or not lengths or max(lengths) == 0:
            return None
        window, size = self.window, cache.block_size
        slots = []
        for seq, n in zip(cache.rows, lengths):
            start = 0
            if window is not None:
                table = self.allocator.sequence(seq).table
                held = next((index for index, block in enumerate(table) if block != HOLE), len(table))
                start = max(0, n - window, held * size)
            slots.append(self.allocator.slots(seq, start, n))
        return gather_rows(storage, slots)

    @property
    def keys(self) -> torch.Tensor | None:
        """Each row's keys (B, H_kv, T, D) gathered from its blocks, right-padded with zeros
        (in the forward's dtype: dequantized when packed)."""
        return self._unpacked(self._gather(self._keys), 0)

    @property
    def values(self) -> torch.Tensor | None:
        """Each row's values (B, H_kv, T, D_v) gathered from its blocks, right-padded with zeros
        (in the forward's dtype: dequantized when packed)."""
        return self._unpacked(self._gather(self._values), 1)

    def _unpacked(self, rows: torch.Tensor | None, kind: int) -> torch.Tensor | None:
        """Gathered rows (kind 0 keys, 1 values) in the forward's dtype (from the kv_dtype's format)."""
        if rows is None or self.formats is None or self.forward_dtype is None:
            return rows
        return self.formats[kind].unpack(rows, self.forward_dtype)

    def _rows_held(self) -> int:
        return self.allocator.num_in_use * self._cache.block_size

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
