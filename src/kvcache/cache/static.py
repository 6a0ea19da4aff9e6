"""StaticLayer: a preallocated buffer of max_cache_len rows, written at absolute positions.

Eager code attends over the filled rows only (a view). Under torch.compile the layer returns
the whole buffer, whose unfilled rows sit at positions greater than every query and are
masked by causality, and it keeps its write position in a 0-d tensor, so shapes and guards
stay the same at every step and one compiled decode step serves the whole generation.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .base import Cache
from .checks import check_crop
from .config import read_cache_geometry
from .errors import CacheConfigError, CacheOverflowError
from .fixed import FixedCapacityLayer
from .layer import CacheLayer, is_compiling
from .sliding import SlidingWindowLayer


class StaticLayer(FixedCapacityLayer):
    """A layer of fixed capacity `max_cache_len`; overflow raises `CacheOverflowError`.

    Args:
        max_cache_len: rows per (batch, kv head), the most tokens the layer can hold.
        batch_size, kv_heads, head_dim, dtype, device: if batch, heads, dim and dtype are all
            given the buffer is allocated now (device default CPU), else by the first update.
    """

    def __init__(
        self,
        max_cache_len: int,
        *,
        batch_size: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(
            max_cache_len,
            batch_size=batch_size,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )

    @property
    def max_cache_len(self) -> int:
        """Capacity in tokens."""
        return self.capacity

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T_new, D) at positions past..past+T_new-1.

        Returns K, V: eager, the filled rows (B, H_kv, past + T_new, D); compiled, the whole
        buffer (B, H_kv, max_cache_len, D). Raises `CacheOverflowError` (eager) when
        past + T_new > max_cache_len.
        """
        self._check_and_allocate(k, v)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        new_tokens = k.shape[2]
        if is_compiling():
            start = self._length.tensor
            assert start is not None
            index = start + torch.arange(new_tokens, device=keys.device)  # (T_new,)
            keys.index_copy_(2, index, k)
            values.index_copy_(2, index, v)
            self._length.advance_compiled(new_tokens)
            return keys, values
        start = self._length.get()
        end = start + new_tokens
        if end > self.capacity:
            raise CacheOverflowError(self.capacity, end, self.layer_idx)
        keys.narrow(2, start, new_tokens).copy_(k)
        values.narrow(2, start, new_tokens).copy_(v)
        self._length.set(end)
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def append_arrays(self, k, v):
        """Eager `update` on numpy arrays (see CacheLayer.append_arrays): the rows written
        through numpy views of the buffers; None when compiling or past max_cache_len (then
        `update` raises CacheOverflowError)."""
        if type(self).update is not StaticLayer.update or is_compiling():
            return None
        start = self._length.get()
        written = self._write_arrays(k, v, start)
        if written is not None:
            self._length.set(start + k.shape[2])
        return written

    def sees_every_key(self, new_tokens: int) -> bool:
        """Eager, one new query sees every filled row (the rows update returns): itself and all
        before it. Compiled, the whole buffer comes back and its unfilled rows are masked."""
        return new_tokens == 1 and not is_compiling()

    def mask_key(self, new_tokens: int) -> Hashable:
        """Eager: causal geometry (past, new_tokens); compiled: the whole buffer."""
        if is_compiling():
            return ("static-buffer", self.capacity, new_tokens)
        return ("causal", self._length.get(), new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past + (0..T_new-1); keys at 0..past+T_new-1 (eager) or at every buffer
        row 0..max_cache_len-1 (compiled: rows past the queries are masked by causality)."""
        if is_compiling() and self._length.tensor is not None:
            past = self._length.tensor
            query_positions = past + torch.arange(new_tokens, device=past.device)  # (T_new,)
            return query_positions, torch.arange(self.capacity, device=past.device)  # (C,)
        past = self._length.get()
        if not is_compiling() and past + new_tokens > self.capacity:
            raise CacheOverflowError(self.capacity, past + new_tokens, self.layer_idx)
        key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past:], key_positions

    @property
    def keys(self) -> torch.Tensor | None:
        """Filled keys (B, H_kv, T, D), a view; None before allocation."""
        return None if self._keys is None else self._keys.narrow(2, 0, self._length.get())

    @property
    def values(self) -> torch.Tensor | None:
        """Filled values (B, H_kv, T, D_v), a view; None before allocation."""
        return None if self._values is None else self._values.narrow(2, 0, self._length.get())

    def _rows_held(self) -> int:
        return self._length.get()

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (later writes overwrite the rest)."""
        check_crop(max_length)
        self._length.set(min(self._length.get(), max_length))


class StaticCache(Cache):
    """A cache of `StaticLayer`s preallocated for `max_batch_size` × `max_cache_len`.

    `StaticCache(max_batch_size, max_cache_len, config=...)`: max_cache_len is required;
    max_batch_size may be None (then the first update fixes the batch). Layers whose config
    marks them "sliding_attention" get a `SlidingWindowLayer` instead.
    kv_heads and head_dim come from `config` or are given; with batch, heads, dim and dtype
    all known the buffers are allocated now, otherwise by each layer's first update.
    max_rollback: extra ring rows of the sliding layers (see `SlidingWindowLayer`).
    """

    def __init__(
        self,
        max_batch_size: int | None = None,
        max_cache_len: int | None = None,
        *,
        config: object = None,
        num_layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        window: int | None = None,
        max_rollback: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        geometry = read_cache_geometry(
            config, num_layers=num_layers, window=window, kv_heads=kv_heads, head_dim=head_dim
        )
        if max_cache_len is None:
            raise CacheConfigError("a static cache needs max_cache_len")
        sizes = {
            "batch_size": max_batch_size,
            "kv_heads": geometry.kv_heads,
            "head_dim": geometry.head_dim,
            "dtype": dtype,
            "device": device,
        }

        def make(kind: str) -> CacheLayer:
            if kind == "sliding":
                return SlidingWindowLayer(
                    geometry.require_window(), max_rollback=max_rollback, **sizes
                )
            return StaticLayer(max_cache_len, **sizes)

        if geometry.layer_kinds is None:
            default = geometry.default_kind
            super().__init__(layer_factory=lambda: make(default), device=device)
        else:
            super().__init__([make(kind) for kind in geometry.layer_kinds], device=device)
