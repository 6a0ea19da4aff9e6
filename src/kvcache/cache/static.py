"""StaticLayer: a preallocated buffer of max_cache_len rows, written at absolute positions.

`StaticLayer.update` returns the filled rows (a view); a write past max_cache_len raises
`CacheOverflowError`. `CompiledStaticLayer` is the same storage for torch.compile: it returns the
whole buffer, whose unfilled rows sit at positions greater than every query and are masked by
causality, and keeps its length in a 0-d tensor, so shapes and guards stay the same at every step
and one compiled decode step serves the whole generation. A cache picks one kind when it is made
(`make_cache("static", compiled=True)`).
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
from .length import LengthInTensor
from .sliding import CompiledSlidingWindowLayer, SlidingWindowLayer


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
        """Write k, v (B, H_kv, T_new, D) at positions past..past+T_new-1; return the filled rows
        K, V (B, H_kv, past + T_new, D). Raises `CacheOverflowError` when past + T_new >
        max_cache_len (nothing written)."""
        self._check_and_allocate(k, v)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        new_tokens = k.shape[2]
        start = self._length
        end = start + new_tokens
        if end > self.capacity:
            raise CacheOverflowError(self.capacity, end, self.layer_idx)
        keys.narrow(2, start, new_tokens).copy_(k)
        values.narrow(2, start, new_tokens).copy_(v)
        self._length = end
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def sees_every_key(self, new_tokens: int) -> bool:
        """One new query sees every filled row (the rows update returns): itself and all before."""
        return new_tokens == 1

    def mask_key(self, new_tokens: int) -> Hashable:
        """Causal geometry (past, new_tokens)."""
        return ("causal", self._length, new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past + (0..T_new-1); keys at 0..past+T_new-1. Raises CacheOverflowError
        when the chunk does not fit."""
        past = self._length
        if past + new_tokens > self.capacity:
            raise CacheOverflowError(self.capacity, past + new_tokens, self.layer_idx)
        key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past:], key_positions

    @property
    def keys(self) -> torch.Tensor | None:
        """Filled keys (B, H_kv, T, D), a view; None before allocation."""
        return None if self._keys is None else self._keys.narrow(2, 0, self._length)

    @property
    def values(self) -> torch.Tensor | None:
        """Filled values (B, H_kv, T, D_v), a view; None before allocation."""
        return None if self._values is None else self._values.narrow(2, 0, self._length)

    def _rows_held(self) -> int:
        return self._length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (later writes overwrite the rest)."""
        check_crop(max_length)
        self._length = min(self._length, max_length)


class CompiledStaticLayer(LengthInTensor, StaticLayer):
    """A StaticLayer for torch.compile: `update` returns the whole buffer (B, H_kv,
    max_cache_len, D) and the length lives in a 0-d tensor (see the module docstring).

    Eager code (a prefill) may use it too; it then checks for overflow, which compiled code
    cannot do without reading the length back to the host.
    """

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v (B, H_kv, T_new, D) at the tensor position; return the whole buffer."""
        self._check_and_allocate(k, v)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        new_tokens = k.shape[2]
        if not is_compiling() and self._length + new_tokens > self.capacity:
            raise CacheOverflowError(self.capacity, self._length + new_tokens, self.layer_idx)
        start = self._tracker.tensor
        assert start is not None
        index = start + torch.arange(new_tokens, device=keys.device)  # (T_new,)
        keys.index_copy_(2, index, k)
        values.index_copy_(2, index, v)
        self._tracker.advance(new_tokens)
        return keys, values

    def sees_every_key(self, new_tokens: int) -> bool:
        """Never: the unfilled rows of the buffer come back too, masked."""
        return False

    def mask_key(self, new_tokens: int) -> Hashable:
        """The whole buffer: the same for every layer and position."""
        return ("static-buffer", self.capacity, new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past + (0..T_new-1) from the tensor length; keys at every buffer row
        0..max_cache_len-1 (rows past the queries are masked by causality)."""
        past = self._tracker.tensor
        if past is None:  # nothing allocated yet: nothing written, past is 0
            return torch.arange(new_tokens, device=device), torch.arange(self.capacity, device=device)
        query_positions = past + torch.arange(new_tokens, device=past.device)  # (T_new,)
        return query_positions, torch.arange(self.capacity, device=past.device)  # (C,)


class StaticCache(Cache):
    """A cache of `StaticLayer`s preallocated for `max_batch_size` × `max_cache_len`.

    `StaticCache(max_batch_size, max_cache_len, config=...)`: max_cache_len is required;
    max_batch_size may be None (then the first update fixes the batch). Layers whose config
    marks them "sliding_attention" get a `SlidingWindowLayer` instead.
    kv_heads and head_dim come from `config` or are given; with batch, heads, dim and dtype
    all known the buffers are allocated now, otherwise by each layer's first update.
    max_rollback: extra ring rows of the sliding layers (see `SlidingWindowLayer`).
    compiled: layers for torch.compile (`CompiledStaticLayer`, `CompiledSlidingWindowLayer`).
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
        compiled: bool = False,
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

        sliding_kind = CompiledSlidingWindowLayer if compiled else SlidingWindowLayer
        static_kind = CompiledStaticLayer if compiled else StaticLayer

        def make(kind: str) -> CacheLayer:
            if kind == "sliding":
                return sliding_kind(geometry.require_window(), max_rollback=max_rollback, **sizes)
            return static_kind(max_cache_len, **sizes)

        if geometry.layer_kinds is None:
            default = geometry.default_kind
            super().__init__(layer_factory=lambda: make(default), device=device)
        else:
            super().__init__([make(kind) for kind in geometry.layer_kinds], device=device)
