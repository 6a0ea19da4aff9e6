"""QuantizedLayer: keys and values stored as int8/int4/fp8 groups behind the same seam.

The most recent tokens stay in full precision (a residual of `residual_length` to
`residual_length + group_size - 1` rows); whenever the residual reaches `residual_length +
group_size` rows, its oldest whole groups of `group_size` tokens are quantized once and appended
to packed storage, which is never re-quantized. So the tokens held quantized after T tokens are
the first floor((T - residual_length) / group_size) · group_size, however T arrived (one
prefill or token by token), and groups start at absolute positions 0, g, 2g, … (a crop only
shortens the residual; the invariant holds again once it has regrown).

`update` returns what is stored: the quantized history dequantized (in the model's dtype) and
the residual after it, (B, H_kv, T, D). The dequantization is redone on every update (O(T) per
step, like the attention that reads it): a dequantized mirror would hold a full-precision copy
and cost more memory than the unquantized cache it replaces.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from .base import Cache
from .checks import check_batch_index, check_crop, where
from .config import read_cache_geometry
from .errors import CacheConfigError, CacheCropError, CacheShapeError
from .layer import CacheLayer, normal_tensors
from .quantize import QuantizedRows, QuantSpec, dequantize, quantize
from .sliding import SlidingWindowLayer

BITS = (8, 4, "fp8")


def quant_spec_args(bits: int | str) -> tuple[str, int]:
    """(kind, bits) of a `bits` argument: 8 or 4 → ("int", bits); "fp8" → ("fp8", 8)."""
    if bits == "fp8":
        return "fp8", 8
    if isinstance(bits, bool) or bits not in (8, 4):
        raise CacheConfigError(f"bits must be one of {BITS}, got {bits!r}")
    return "int", int(bits)


class _PackedStore:
    """Quantized rows of one tensor (keys or values), grown along the token dim in whole groups.

    data (B, H, capacity, D or D/2); scale and zero (B, H, capacity or capacity / g, ·). Only
    the first `tokens` tokens are live.
    """

    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.tokens = 0
        self.capacity = 0
        self.buffers: list[torch.Tensor] = []  # data, scale[, zero]

    def _scale_rows(self, tokens: int) -> int:
        return tokens if self.spec.axis == "token" else tokens // self.spec.group_size

    def _live(self) -> list[torch.Tensor]:
        rows = [self.tokens, self._scale_rows(self.tokens), self._scale_rows(self.tokens)]
        return [buffer.narrow(2, 0, count) for buffer, count in zip(self.buffers, rows)]

    def rows(self) -> QuantizedRows:
        """The live quantized rows."""
        live = self._live()
        return QuantizedRows(live[0], live[1], live[2] if len(live) > 2 else None)

    def append(self, rows: QuantizedRows) -> None:
        """Append the quantized rows of a whole number of groups."""
        parts = [rows.data, rows.scale] + ([] if rows.zero is None else [rows.zero])
        new_tokens = rows.data.shape[2]
        end = self.tokens + new_tokens
        if end > self.capacity:
            group = self.spec.group_size
            wanted = max(end, int(self.capacity * 1.5))
            capacity = -(-wanted // group) * group
            grown = []
            for index, part in enumerate(parts):
                rows_for = capacity if index == 0 else self._scale_rows(capacity)
                with normal_tensors():
                    buffer = part.new_empty((*part.shape[:2], rows_for, part.shape[3]))  # (B, H, C, ·)
                if self.buffers:
                    live = self._live()[index]
                    buffer.narrow(2, 0, live.shape[2]).copy_(live)
                grown.append(buffer)
            self.buffers, self.capacity = grown, capacity
        starts = [self.tokens, self._scale_rows(self.tokens), self._scale_rows(self.tokens)]
        for buffer, start, part in zip(self.buffers, starts, parts):
            buffer.narrow(2, start, part.shape[2]).copy_(part)
        self.tokens = end

    def map_batch(self, function) -> None:
        """Replace every buffer by function(buffer) (batch selection / repetition)."""
        with normal_tensors():
            self.buffers = [function(buffer) for buffer in self.buffers]

    @property
    def nbytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.buffers)

    @property
    def nbytes_used(self) -> int:
        return sum(part.nbytes for part in self._live()) if self.buffers else 0


class QuantizedLayer(CacheLayer):
    """A layer that stores keys and values quantized in groups, the newest in full precision.

    Args:
        bits: 8 or 4 (asymmetric integer codes with a scale and zero point per group), or
            "fp8" (torch.float8_e4m3fn with a scale per group).
        group_size: tokens per group for axis "channel"; channels per group for axis "token"
            (the whole head if it has fewer); also the flush granularity of the residual.
        residual_length: the most recent tokens always kept in full precision (at least this
            many, fewer than residual_length + group_size); crop can roll back this far.
        key_axis, value_axis: "channel" (a scale per channel per group of tokens) or "token"
            (a scale per token per group of channels). Defaults: keys per channel (their
            outlier channels then get their own scales), values per token.
        scale_dtype: dtype of scales and zero points (default: the model's dtype).
    """

    def __init__(
        self,
        *,
        bits: int | str = 8,
        group_size: int = 64,
        residual_length: int = 128,
        key_axis: str = "channel",
        value_axis: str = "token",
        scale_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.kind, self.bits = quant_spec_args(bits)
        if isinstance(residual_length, bool) or not isinstance(residual_length, int) or residual_length < 0:
            raise CacheConfigError(f"residual_length must be an int >= 0, got {residual_length!r}")
        self.group_size = group_size
        self.residual_length = residual_length
        self.scale_dtype = scale_dtype
        # checks every argument now, with a placeholder scale dtype
        QuantSpec(self.kind, self.bits, group_size, key_axis)
        QuantSpec(self.kind, self.bits, group_size, value_axis)
        self.key_axis, self.value_axis = key_axis, value_axis
        self._key_store: _PackedStore | None = None
        self._value_store: _PackedStore | None = None
        self._residual = 0  # live rows of the residual buffers self._keys / self._values

    # ---- storage ------------------------------------------------------------------------------
    def _allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        scale_dtype = self.scale_dtype or k.dtype
        key_spec = QuantSpec(self.kind, self.bits, self.group_size, self.key_axis, scale_dtype)
        value_spec = QuantSpec(self.kind, self.bits, self.group_size, self.value_axis, scale_dtype)
        try:
            key_spec.check_head_dim(k.shape[3])
            value_spec.check_head_dim(v.shape[3])
        except CacheConfigError as error:
            raise CacheShapeError(f"{error}{where(self.layer_idx)}") from None
        self._key_store, self._value_store = _PackedStore(key_spec), _PackedStore(value_spec)
        rows = max(1, self.residual_length + self.group_size - 1)  # the most a residual holds
        batch, heads = k.shape[:2]
        with normal_tensors():
            self._keys = k.new_empty((batch, heads, rows, k.shape[3]))  # (B, H_kv, R + g - 1, D)
            self._values = v.new_empty((batch, heads, rows, v.shape[3]))  # (B, H_kv, R + g - 1, D_v)

    @property
    def quantized_tokens(self) -> int:
        """Tokens held in quantized storage (a multiple of group_size)."""
        return 0 if self._key_store is None else self._key_store.tokens

    @property
    def residual_tokens(self) -> int:
        """Tokens held in full precision."""
        return self._residual

    # ---- the seam -------------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D); return K, V (B, H_kv, past + T_new, D) as stored
        (the quantized part dequantized), in k's dtype."""
        self._check(k, v)
        if self._keys is None:
            self._allocate(k, v)
        keys, values = self._keys, self._values
        key_store, value_store = self._key_store, self._value_store
        assert keys is not None and values is not None
        assert key_store is not None and value_store is not None
        held, new_tokens = self._residual, k.shape[2]
        total = held + new_tokens
        flush = 0
        if total >= self.residual_length + self.group_size:
            flush = (total - self.residual_length) // self.group_size * self.group_size
        if flush:
            all_keys = torch.cat([keys.narrow(2, 0, held), k], dim=2) if held else k  # (B, H, total, D)
            all_values = torch.cat([values.narrow(2, 0, held), v], dim=2) if held else v
            key_store.append(quantize(all_keys.narrow(2, 0, flush), key_store.spec))
            value_store.append(quantize(all_values.narrow(2, 0, flush), value_store.spec))
            keys.narrow(2, 0, total - flush).copy_(all_keys.narrow(2, flush, total - flush))
            values.narrow(2, 0, total - flush).copy_(all_values.narrow(2, flush, total - flush))
        else:
            keys.narrow(2, held, new_tokens).copy_(k)
            values.narrow(2, held, new_tokens).copy_(v)
        self._residual = total - flush
        return self._visible(keys, key_store), self._visible(values, value_store)

    def _visible(self, residual: torch.Tensor, store: _PackedStore) -> torch.Tensor:
        """(B, H_kv, T, D): dequantized history then the residual, in a new tensor."""
        quantized = store.tokens
        batch, heads, _, dim = residual.shape
        out = residual.new_empty((batch, heads, quantized + self._residual, dim))  # (B, H, T, D)
        if quantized:
            dequantize(store.rows(), store.spec, residual.dtype, out=out.narrow(2, 0, quantized))
        out.narrow(2, quantized, self._residual).copy_(residual.narrow(2, 0, self._residual))
        return out

    def get_seq_length(self) -> int:
        """Tokens held (quantized + full precision)."""
        return self.quantized_tokens + self._residual

    def mask_key(self, new_tokens: int) -> Hashable:
        """Causal geometry: (past, new_tokens), the same as a dynamic layer's."""
        return ("causal", self.get_seq_length(), new_tokens)

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries at past..past+T_new-1 (T_new,); keys at 0..past+T_new-1 (past + T_new,)."""
        past = self.get_seq_length()
        key_positions = torch.arange(past + new_tokens, device=device)  # (T_kv,)
        return key_positions[past:], key_positions

    @property
    def keys(self) -> torch.Tensor | None:
        """Keys (B, H_kv, T, D) as stored (dequantized), a new tensor; None before the first update."""
        if self._keys is None or self._key_store is None:
            return None
        return self._visible(self._keys, self._key_store)

    @property
    def values(self) -> torch.Tensor | None:
        """Values (B, H_kv, T, D_v) as stored (dequantized), a new tensor; None before the first update."""
        if self._values is None or self._value_store is None:
            return None
        return self._visible(self._values, self._value_store)

    # ---- whole-layer operations -------------------------------------------------------------------
    def validate_crop(self, max_length: int) -> None:
        """Raise `CacheCropError` unless only full-precision tokens would be dropped."""
        check_crop(max_length)
        if max_length < self.quantized_tokens and max_length < self.get_seq_length():
            raise CacheCropError(
                f"cannot crop a quantized layer{where(self.layer_idx)} to {max_length} tokens: "
                f"its first {self.quantized_tokens} tokens are quantized in groups of "
                f"{self.group_size} and only the last {self._residual} are held in full "
                f"precision; crop to >= {self.quantized_tokens}, or build the cache with "
                f"residual_length >= the rollback you need"
            )

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (only full-precision ones can be dropped)."""
        self.validate_crop(max_length)
        if max_length < self.get_seq_length():
            self._residual = max_length - self.quantized_tokens

    def reset(self) -> None:
        """Forget every token; allocated storage is kept for reuse."""
        self._residual = 0
        for store in (self._key_store, self._value_store):
            if store is not None:
                store.tokens = 0

    def select(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` (1-D long, in that order, repeats allowed)."""
        if self._keys is None or self._values is None:
            return
        index = check_batch_index(indices, self._keys.shape[0], self._keys.device)
        self._map_batch(lambda tensor: tensor.index_select(0, index))

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times (B → B × repeats), e.g. for beams."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheShapeError(f"repeats must be an int >= 1, got {repeats!r}")
        if self._keys is not None:
            self._map_batch(lambda tensor: tensor.repeat_interleave(repeats, dim=0))

    def _map_batch(self, function) -> None:
        assert self._keys is not None and self._values is not None
        with normal_tensors():
            self._keys, self._values = function(self._keys), function(self._values)
        for store in (self._key_store, self._value_store):
            if store is not None:
                store.map_batch(function)

    @property
    def nbytes(self) -> int:
        """Bytes allocated: packed codes, scales and zero points, and the residual buffers."""
        if self._keys is None or self._values is None:
            return 0
        stores = (self._key_store, self._value_store)
        return self._keys.nbytes + self._values.nbytes + sum(s.nbytes for s in stores if s is not None)

    @property
    def nbytes_used(self) -> int:
        """Bytes of live tokens: packed codes with their scales and zero points, plus the
        full-precision residual rows (what `kvcache.memory.quantized_kv_cache_bytes` predicts)."""
        if self._keys is None or self._values is None:
            return 0
        residual = self._residual * (self._keys[0, :, 0].nbytes + self._values[0, :, 0].nbytes)
        stores = (self._key_store, self._value_store)
        return residual * self._keys.shape[0] + sum(s.nbytes_used for s in stores if s is not None)

    def _rows_held(self) -> int:
        return self.get_seq_length()


class QuantizedCache(Cache):
    """A cache of `QuantizedLayer`s (see there for bits, group_size, residual_length, axes).

    Layers a config marks "sliding_attention" keep a `SlidingWindowLayer` in full precision
    (its ring is already bounded by the window).

    Args:
        num_layers: layer count; if None (and no config), layers are created on first use.
        config: model config (object or dict), as for `DynamicCache`.
        window, max_rollback: for the sliding layers, as for `DynamicCache`.
        device: where masks are built while the cache is empty.
    """

    def __init__(
        self,
        num_layers: int | None = None,
        *,
        bits: int | str = 8,
        group_size: int = 64,
        residual_length: int = 128,
        key_axis: str = "channel",
        value_axis: str = "token",
        scale_dtype: torch.dtype | None = None,
        config: object = None,
        window: int | None = None,
        device: torch.device | str | None = None,
        max_rollback: int = 0,
    ) -> None:
        geometry = read_cache_geometry(config, num_layers=num_layers, window=window)
        options = dict(
            bits=bits,
            group_size=group_size,
            residual_length=residual_length,
            key_axis=key_axis,
            value_axis=value_axis,
            scale_dtype=scale_dtype,
        )
        QuantizedLayer(**options)  # check the arguments even if no layer is built yet
        self.kind, self.bits = quant_spec_args(bits)
        self.group_size, self.residual_length = group_size, residual_length

        def quantized() -> CacheLayer:
            return QuantizedLayer(**options)

        def sliding() -> CacheLayer:
            return SlidingWindowLayer(geometry.require_window(), max_rollback=max_rollback)

        if geometry.layer_kinds is None:
            factory = sliding if geometry.default_kind == "sliding" else quantized
            super().__init__(layer_factory=factory, device=device)
            return
        layers = [sliding() if kind == "sliding" else quantized() for kind in geometry.layer_kinds]
        super().__init__(layers, device=device)
