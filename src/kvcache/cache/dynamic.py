"""DynamicLayer: keys and values in a buffer that grows geometrically; update returns a view.

Appending one token writes one row and never copies the history: when the buffer is full its
capacity grows by `growth` (rounded up to `step` rows), so the copies cost O(1) per token
amortised, where `torch.cat` onto the history costs O(n) per token.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .base import Cache
from .checks import check_crop
from .config import read_cache_geometry
from .layer import CacheLayer, normal_tensors
from .sliding import SlidingWindowLayer


class DynamicLayer(CacheLayer):
    """A layer that holds every token it is given, shaped by its first update.

    Args:
        step: capacity is a multiple of this many rows (and at least one step).
        growth: factor by which a full buffer grows (> 1, so appends are amortised O(1)).
    """

    def __init__(self, *, step: int = 256, growth: float = 1.5) -> None:
        super().__init__()
        if step < 1 or growth <= 1.0:
            raise ValueError(f"need step >= 1 and growth > 1, got step={step}, growth={growth}")
        self.step = step
        self.growth = growth
        self._length = 0

    def _capacity_for(self, needed: int, current: int) -> int:
        wanted = max(needed, int(current * self.growth))
        return -(-wanted // self.step) * self.step

    def _grow(self, k: torch.Tensor, v: torch.Tensor, needed: int) -> None:
        old_keys, old_values = self._keys, self._values
        current = 0 if old_keys is None else old_keys.shape[2]
        capacity = self._capacity_for(needed, current)
        batch, heads, _, head_dim = k.shape
        self._forget_arrays()  # views of the old buffers would keep them alive
        with normal_tensors():
            self._keys = k.new_empty((batch, heads, capacity, head_dim))  # (B, H_kv, C, D)
            self._values = v.new_empty((batch, heads, capacity, v.shape[3]))  # (B, H_kv, C, D_v)
        if old_keys is not None and old_values is not None and self._length:
            self._keys.narrow(2, 0, self._length).copy_(old_keys.narrow(2, 0, self._length))
            self._values.narrow(2, 0, self._length).copy_(old_values.narrow(2, 0, self._length))

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, H_kv, T_new, D); return views K, V (B, H_kv, past + T_new, D)."""
        self._check(k, v)
        start = self._length
        end = start + k.shape[2]
        if self._keys is None or end > self._keys.shape[2]:
            self._grow(k, v, end)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        keys.narrow(2, start, k.shape[2]).copy_(k)
        values.narrow(2, start, k.shape[2]).copy_(v)
        self._length = end
        return keys.narrow(2, 0, end), values.narrow(2, 0, end)

    def get_seq_length(self) -> int:
        """Tokens held (every token seen since the last reset/crop)."""
        return self._length

    def mask_key(self, new_tokens: int) -> Hashable:
        """Causal geometry: (past, new_tokens)."""
        return ("causal", self._length, new_tokens)

    def sees_every_key(self, new_tokens: int) -> bool:
        """One new query sees every key held: itself and all before it."""
        return new_tokens == 1

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past..past+T_new-1 (T_new,); keys at 0..past+T_new-1 (past + T_new,)."""
        past = self._length
        key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past:], key_positions

    @property
    def keys(self) -> torch.Tensor | None:
        """Keys (B, H_kv, T, D), a view of the buffer; None before the first update."""
        return None if self._keys is None else self._keys.narrow(2, 0, self._length)

    @property
    def values(self) -> torch.Tensor | None:
        """Values (B, H_kv, T, D_v), a view of the buffer; None before the first update."""
        return None if self._values is None else self._values.narrow(2, 0, self._length)

    @property
    def capacity(self) -> int:
        """Rows allocated (0 before the first update)."""
        return 0 if self._keys is None else self._keys.shape[2]

    def _rows_held(self) -> int:
        return self._length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens; the capacity is kept."""
        check_crop(max_length)
        self._length = min(self._length, max_length)

    def reset(self) -> None:
        """Forget every token; the capacity is kept."""
        self._length = 0


class DynamicCache(Cache):
    """A cache of `DynamicLayer`s that grows with the sequence.

    Layers whose config marks them "sliding_attention" get a `SlidingWindowLayer` of the
    config's window, so a mixed model keeps its per-layer attention pattern.

    Args:
        num_layers: layer count; if None (and no config), layers are created on first use.
        config: model config (object or dict) with num_hidden_layers, sliding_window,
            layer_types; see `kvcache.cache.config.read_cache_geometry`.
        window: sliding window for the sliding layers (must agree with config.sliding_window).
        max_rollback: extra ring rows of the sliding layers, so `crop` can roll back that many
            tokens after the window has filled (speculative decoding).
        device: where masks are built while the cache is empty.
        step, growth: passed to each `DynamicLayer`.
    """

    def __init__(
        self,
        num_layers: int | None = None,
        *,
        config: object = None,
        window: int | None = None,
        device: torch.device | str | None = None,
        max_rollback: int = 0,
        step: int = 256,
        growth: float = 1.5,
    ) -> None:
        geometry = read_cache_geometry(config, num_layers=num_layers, window=window)

        def full() -> CacheLayer:
            return DynamicLayer(step=step, growth=growth)

        if geometry.layer_kinds is None:
            if geometry.default_kind == "sliding":
                window_size = geometry.require_window()

                def sliding() -> CacheLayer:
                    return SlidingWindowLayer(window_size, max_rollback=max_rollback)

                super().__init__(layer_factory=sliding, device=device)
            else:
                super().__init__(layer_factory=full, device=device)
            return
        layers = [
            SlidingWindowLayer(geometry.require_window(), max_rollback=max_rollback)
            if kind == "sliding"
            else full()
            for kind in geometry.layer_kinds
        ]
        super().__init__(layers, device=device)
