"""SlidingWindowLayer: a ring buffer holding the last `window` positions of each sequence.

A query at position q sees the keys at (q - window, q]: itself and the window-1 before it.
Position p lives in slot p % capacity (capacity = window + max_rollback), so after wrap-around
the slots are out of order; the layer reports each returned row's absolute position and the
mask is built from positions, never from slot indices.

A single new token is written into the ring and the ring is returned. A chunk of several
tokens that crosses the ring's end is returned as (ring, chunk) concatenated, because its early
queries still need rows the chunk will overwrite; that also covers a chunk longer than the
window (prefill), after which the ring keeps the chunk's last rows.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .base import Cache
from .checks import check_crop
from .config import read_cache_geometry
from .errors import CacheConfigError, CacheCropError, CacheShapeError
from .fixed import FixedCapacityLayer
from .length import LengthInTensor


def ring_positions(last: int | torch.Tensor, capacity: int, slots: torch.Tensor) -> torch.Tensor:
    """Absolute position held by each slot when `last` is the newest position written.

    slots: (S,) long slot indices. Returns (S,) long; negative = never written.
    """
    return last - torch.remainder(last - slots, capacity)


class SlidingWindowLayer(FixedCapacityLayer):
    """A fixed ring of `window + max_rollback` rows that keeps the last positions.

    Args:
        window: a query sees itself and the window-1 keys before it.
        max_rollback: extra rows kept so that `crop` can roll back up to max_rollback tokens
            after the ring has wrapped (speculative decoding); 0 keeps exactly `window`.
        batch_size, kv_heads, head_dim, dtype, device: as for `StaticLayer`.
    """

    def __init__(
        self,
        window: int,
        *,
        max_rollback: int = 0,
        batch_size: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise CacheConfigError(f"window must be an int >= 1, got {window!r}")
        if max_rollback < 0:
            raise CacheConfigError(f"max_rollback must be >= 0, got {max_rollback}")
        super().__init__(
            window + max_rollback,
            batch_size=batch_size,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
        )
        self.window = window
        self.max_rollback = max_rollback
        # the longest length reached before the last crop: positions below
        # high_water - capacity have been overwritten in the ring and cannot come back
        self._high_water = 0

    # ---- geometry: which rows update() returns ----------------------------------------------
    def _returns_prefix(self, past: int, new_tokens: int) -> bool:
        """Eager and not yet wrapped: update returns slots [0, past + new_tokens)."""
        return past + new_tokens <= self.capacity

    def mask_key(self, new_tokens: int) -> Hashable:
        """Ring size, past and chunk length determine the mask."""
        return ("ring", self.capacity, self._length, new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past + (0..T_new-1) (T_new,); keys at the absolute positions of the rows
        the next update returns (T_kv,), -1 for a slot never written."""
        past = self._length
        if self._returns_prefix(past, new_tokens):
            key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
            return key_positions[past:], key_positions
        slots = torch.arange(min(past, self.capacity), device=device)  # (C or past,)
        return self._ring_positions(past, new_tokens, slots)

    def _ring_positions(
        self, past: int | torch.Tensor, new_tokens: int, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(query positions (T_new,), key positions) of an update that returns the ring's
        `slots` (and, for a chunk of several tokens, the chunk after them)."""
        capacity = self.capacity
        query_positions = past + torch.arange(new_tokens, device=slots.device)  # (T_new,)
        if new_tokens == 1:
            # written into the ring first, so the newest position is the query's own
            return query_positions, ring_positions(past, capacity, slots)
        ring = ring_positions(past - 1, capacity, slots)
        return query_positions, torch.cat([ring, query_positions])  # (C + T_new,)

    # ---- update ---------------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D); keep the last `capacity` positions.

        Returns K, V whose rows sit at the positions `mask_positions` reported:
        not yet wrapped (eager): slots [0, past + T_new); one token: the whole ring (C rows);
        several tokens otherwise: the ring before the write, then the chunk (C' + T_new rows).
        """
        self._check_and_allocate(k, v)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        new_tokens = k.shape[2]
        past = self._length
        end = past + new_tokens
        if self._returns_prefix(past, new_tokens):
            keys.narrow(2, past, new_tokens).copy_(k)
            values.narrow(2, past, new_tokens).copy_(v)
            self._length = end
            return keys.narrow(2, 0, end), values.narrow(2, 0, end)
        if new_tokens == 1:
            slot = past % self.capacity
            keys.narrow(2, slot, 1).copy_(k)
            values.narrow(2, slot, 1).copy_(v)
            self._length = end
            return keys, values
        held = min(past, self.capacity)
        out_keys = torch.cat([keys.narrow(2, 0, held), k], dim=2)  # (B, H_kv, held + T_new, D)
        out_values = torch.cat([values.narrow(2, 0, held), v], dim=2)  # (B, H_kv, held+T_new, D_v)
        self._write_tail(k, v, past)
        self._length = end
        return out_keys, out_values

    def load_recent(self, keys: torch.Tensor, values: torch.Tensor, seq_length: int) -> None:
        """Hold a sequence of `seq_length` tokens of which keys, values (B, H_kv, n, D) are the
        last n (positions seq_length - n .. seq_length - 1), the earlier ones already evicted:
        a cache filled elsewhere (a transformers sliding layer keeps the last window - 1).
        n must cover what the next query needs, min(seq_length, window - 1) rows; the ring
        keeps the last `capacity` of them. Raises `CacheShapeError` for too few rows."""
        held = keys.shape[2] if keys.dim() == 4 else -1
        needed = min(seq_length, self.window - 1)
        whole = isinstance(seq_length, int) and not isinstance(seq_length, bool)
        if not whole or not needed <= held <= seq_length:
            raise CacheShapeError(
                f"load_recent needs between min(seq_length, window - 1) = {needed} and "
                f"seq_length = {seq_length} rows of (batch, kv_heads, rows, head_dim) keys, got "
                f"shape {tuple(keys.shape)}"
            )
        if held:
            self._check_and_allocate(keys, values)
            self._write_tail(keys, values, seq_length - held)
        self._length = seq_length
        # positions below seq_length - held were never given: crop must not reach for them
        self._high_water = seq_length - min(held, self.capacity) + self.capacity

    def _write_tail(self, k: torch.Tensor, v: torch.Tensor, past: int) -> None:
        """Write the last min(T_new, C) rows of the chunk into their slots (at most two runs)."""
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        capacity = self.capacity
        kept = min(k.shape[2], capacity)
        first = past + k.shape[2] - kept  # absolute position of the first kept row
        done = 0
        while done < kept:
            slot = (first + done) % capacity
            run = min(kept - done, capacity - slot)
            source = k.shape[2] - kept + done
            keys.narrow(2, slot, run).copy_(k.narrow(2, source, run))
            values.narrow(2, slot, run).copy_(v.narrow(2, source, run))
            done += run

    # ---- views and bookkeeping -------------------------------------------------------------
    def _ordered(self, buffer: torch.Tensor | None) -> torch.Tensor | None:
        if buffer is None:
            return None
        length = self._length
        held = min(length, self.window)
        first = length - held
        slots = torch.remainder(
            torch.arange(first, length, device=buffer.device), self.capacity
        )  # (held,)
        return buffer.index_select(2, slots)  # (B, H_kv, held, D)

    @property
    def keys(self) -> torch.Tensor | None:
        """The last min(T, window) keys (B, H_kv, T_held, D) in position order (a copy)."""
        return self._ordered(self._keys)

    @property
    def values(self) -> torch.Tensor | None:
        """The last min(T, window) values (B, H_kv, T_held, D_v) in position order (a copy)."""
        return self._ordered(self._values)

    @property
    def positions(self) -> torch.Tensor:
        """Absolute positions (T_held,) of the rows `keys`/`values` show."""
        length = self._length
        return torch.arange(length - min(length, self.window), length)

    def _rows_held(self) -> int:
        return min(self._length, self.window)

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens.

        The ring has overwritten every position below (longest length reached) - capacity;
        a crop whose visible window would need one of those raises `CacheCropError`. Right
        after a wrap that allows rolling back `max_rollback` tokens.
        """
        self.validate_crop(max_length)
        length = self._length
        self._high_water = max(self._high_water, length)
        self._length = min(max_length, length)

    def reset(self) -> None:
        """Forget every token; the ring's storage is kept for reuse."""
        super().reset()
        self._high_water = 0

    def validate_crop(self, max_length: int) -> None:
        """Raise `CacheCropError` if crop(max_length) would need rows the ring has evicted."""
        check_crop(max_length)
        length = self._length
        if max_length >= length:
            return
        evicted_below = max(0, max(self._high_water, length) - self.capacity)
        first_visible = max(0, max_length - self.window)
        if first_visible < evicted_below:
            raise CacheCropError(
                f"sliding layer{'' if self.layer_idx is None else f' {self.layer_idx}'} no longer "
                f"holds positions below {evicted_below} (window {self.window}, max_rollback "
                f"{self.max_rollback}); crop({max_length}) from length {length} would need "
                f"positions {first_visible}..{max_length - 1}; build the layer with a larger "
                f"max_rollback"
            )


class CompiledSlidingWindowLayer(LengthInTensor, SlidingWindowLayer):
    """A SlidingWindowLayer for torch.compile: `update` returns the whole ring (a chunk: the
    ring, then the chunk) and the length lives in a 0-d tensor, so a compiled step does not
    specialise on the position. Rows of slots never written sit at negative positions (masked)."""

    def mask_key(self, new_tokens: int) -> Hashable:
        """The whole ring: the same for every layer and position."""
        return ("ring-compiled", self.capacity, new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past + (0..T_new-1) from the tensor length; keys at the absolute position
        of every ring slot (-1 or less: never written), then the chunk's own for T_new > 1."""
        past = self._tracker.tensor
        if past is None:  # nothing allocated yet: nothing written, past is 0
            past = torch.zeros((), dtype=torch.long, device=device)
        return self._ring_positions(past, new_tokens, torch.arange(self.capacity, device=past.device))

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D) at the tensor position; return the ring (C rows) for
        one token, or the ring before the write and then the chunk (C + T_new rows)."""
        self._check_and_allocate(k, v)
        keys, values = self._keys, self._values
        assert keys is not None and values is not None
        past = self._tracker.tensor
        assert past is not None
        new_tokens = k.shape[2]
        kept = min(new_tokens, self.capacity)
        positions = past + torch.arange(new_tokens - kept, new_tokens, device=past.device)
        slots = torch.remainder(positions, self.capacity)  # (kept,)
        if new_tokens == 1:
            keys.index_copy_(2, slots, k)
            values.index_copy_(2, slots, v)
            self._tracker.advance(new_tokens)
            return keys, values
        out_keys = torch.cat([keys, k], dim=2)  # (B, H_kv, C + T_new, D)
        out_values = torch.cat([values, v], dim=2)  # (B, H_kv, C + T_new, D_v)
        keys.index_copy_(2, slots, k.narrow(2, new_tokens - kept, kept))
        values.index_copy_(2, slots, v.narrow(2, new_tokens - kept, kept))
        self._tracker.advance(new_tokens)
        return out_keys, out_values


class SlidingWindowCache(Cache):
    """A cache whose every layer is a `SlidingWindowLayer` of `window` rows.

    For a model whose layer_types mix full and sliding attention use `StaticCache` or
    `DynamicCache`, which give each layer its kind; a config with full-attention layers is
    refused here rather than silently windowed. compiled: `CompiledSlidingWindowLayer`s, for
    torch.compile.
    """

    def __init__(
        self,
        window: int | None = None,
        max_batch_size: int | None = None,
        *,
        config: object = None,
        num_layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        max_rollback: int = 0,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        compiled: bool = False,
    ) -> None:
        geometry = read_cache_geometry(
            config, num_layers=num_layers, window=window, kv_heads=kv_heads, head_dim=head_dim
        )
        size = geometry.require_window()
        layer_kind = CompiledSlidingWindowLayer if compiled else SlidingWindowLayer
        if geometry.layer_kinds is not None and "full" in geometry.layer_kinds:
            full = [i for i, kind in enumerate(geometry.layer_kinds) if kind == "full"]
            raise CacheConfigError(
                f"a sliding cache windows every layer, but the config marks layers {full} as "
                f"full attention; use make_cache('static' or 'dynamic'), which keeps them full"
            )

        def make() -> SlidingWindowLayer:
            return layer_kind(
                size,
                max_rollback=max_rollback,
                batch_size=max_batch_size,
                kv_heads=geometry.kv_heads,
                head_dim=geometry.head_dim,
                dtype=dtype,
                device=device,
            )

        if geometry.num_layers is None:
            super().__init__(layer_factory=make, device=device)
        else:
            super().__init__([make() for _ in range(geometry.num_layers)], device=device)
