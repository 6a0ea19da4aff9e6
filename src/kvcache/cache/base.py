"""The seam between model and cache: `CacheLayer` (one layer's keys and values) and `Cache`.

A `Cache` is an ordered list of layers. The model calls `attention_masks(new_tokens)` once per
forward, then `update(k, v, layer_idx)` once per layer; a layer's length moves only inside its
`update`. Every layer kind answers the same questions (its length, the absolute positions of
the rows it will return), so the model never branches on the kind of cache.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from .errors import (
    CacheCropError,
    CacheDeviceError,
    CacheDtypeError,
    CacheShapeError,
    LayerIndexError,
)
from .masks import build_mask


def is_compiling() -> bool:
    """True while torch.compile traces the code (then no Python int may track the length)."""
    return torch.compiler.is_compiling()


class CacheLayer:
    """Keys and values of one attention layer, stored as (B, H_kv, T, D) after RoPE.

    Subclasses implement `update`, `get_seq_length`, `mask_key`, `mask_positions`, the
    `keys`/`values` views and `crop`. Storage is allocated lazily by the first update unless a
    subclass was given every size up front.
    """

    #: a query at q sees keys in (q - window, q]; None = plain causal.
    window: int | None = None

    def __init__(self) -> None:
        self.layer_idx: int | None = None  # set by Cache, only for error messages
        self._keys: torch.Tensor | None = None  # (B, H_kv, capacity, D)
        self._values: torch.Tensor | None = None  # (B, H_kv, capacity, D_v)

    # ---- the seam -------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D) and return K, V (B, H_kv, T_visible, D) to attend."""
        raise NotImplementedError

    def get_seq_length(self) -> int:
        """Tokens this layer has seen so far (absolute, including evicted ones)."""
        raise NotImplementedError

    def mask_key(self, new_tokens: int) -> Hashable:
        """A key equal for two layers exactly when their masks for this chunk are equal."""
        raise NotImplementedError

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions for the next update of `new_tokens` rows, asked before that update.

        Returns (query_positions (T_new,), key_positions (T_kv,)) long tensors, where T_kv is the
        length of K the next update returns and -1 marks a key slot that holds no token.
        """
        raise NotImplementedError

    @property
    def keys(self) -> torch.Tensor | None:
        """The visible keys (B, H_kv, T, D) in position order; None before the first update."""
        raise NotImplementedError

    @property
    def values(self) -> torch.Tensor | None:
        """The visible values (B, H_kv, T, D_v) in position order; None before the first update."""
        raise NotImplementedError

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (a no-op if fewer are held)."""
        raise NotImplementedError

    def validate_crop(self, max_length: int) -> None:
        """Raise `CacheCropError` if `crop(max_length)` is impossible; change nothing."""
        check_crop(max_length)

    def reset(self) -> None:
        """Forget every token; allocated storage is kept for reuse."""
        raise NotImplementedError

    # ---- shared -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        """Device of the stored tensors, None before allocation."""
        return None if self._keys is None else self._keys.device

    @property
    def batch_size(self) -> int | None:
        """Batch size of the stored tensors, None before allocation."""
        return None if self._keys is None else self._keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not just the rows in use)."""
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    @property
    def nbytes_used(self) -> int:
        """Bytes of the rows that hold live tokens: B × H_kv × T_held × (D + D_v) × itemsize."""
        if self._keys is None or self._values is None:
            return 0
        capacity = self._keys.shape[2]
        per_row = (self._keys.nbytes + self._values.nbytes) // capacity
        return self._rows_held() * per_row

    def _rows_held(self) -> int:
        """Rows of storage that hold live tokens."""
        raise NotImplementedError

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise a named error unless k, v fit each other and what is stored."""
        stored, stored_values = self._keys, self._values
        if stored is not None and stored_values is not None and type(k) is type(v) is torch.Tensor:
            # fast path of the decode loop: one pass of comparisons, no messages built
            ks, vs, sk, sv = k.shape, v.shape, stored.shape, stored_values.shape
            if (
                len(ks) == 4
                and len(vs) == 4
                and ks[0] == vs[0] == sk[0]
                and ks[1] == vs[1] == sk[1]
                and ks[2] == vs[2] >= 1
                and ks[3] == sk[3]
                and vs[3] == sv[3]
                and k.dtype == v.dtype == stored.dtype
                and k.device == v.device == stored.device
            ):
                return
        check_kv_pair(k, v, self.layer_idx)
        stored = self._keys
        if stored is None or self._values is None:
            return
        where = _where(self.layer_idx)
        if k.shape[0] != stored.shape[0] or k.shape[1] != stored.shape[1]:
            raise CacheShapeError(
                f"k{where} has batch {k.shape[0]} and {k.shape[1]} kv heads; the cache holds "
                f"batch {stored.shape[0]} and {stored.shape[1]} kv heads"
            )
        if k.shape[3] != stored.shape[3] or v.shape[3] != self._values.shape[3]:
            raise CacheShapeError(
                f"k, v{where} have head dims {k.shape[3]}, {v.shape[3]}; the cache holds "
                f"{stored.shape[3]}, {self._values.shape[3]}"
            )
        if k.dtype != stored.dtype or v.dtype != stored.dtype:
            raise CacheDtypeError(
                f"k, v{where} have dtypes {k.dtype}, {v.dtype}; the cache stores {stored.dtype}"
            )
        if k.device != stored.device or v.device != stored.device:
            raise CacheDeviceError(
                f"k, v{where} are on {k.device}, {v.device}; the cache is on {stored.device}"
            )

    def select(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` (1-D long, in that order, repeats allowed)."""
        if self._keys is None or self._values is None:
            return
        index = check_batch_index(indices, self._keys.shape[0], self._keys.device)
        self._keys = self._keys.index_select(0, index)  # (B', H_kv, capacity, D)
        self._values = self._values.index_select(0, index)  # (B', H_kv, capacity, D_v)

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times in place (B → B × repeats), e.g. for beams."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheShapeError(f"repeats must be an int >= 1, got {repeats!r}")
        if self._keys is None or self._values is None:
            return
        self._keys = self._keys.repeat_interleave(repeats, dim=0)  # (B·r, H_kv, capacity, D)
        self._values = self._values.repeat_interleave(repeats, dim=0)  # (B·r, H_kv, cap, D_v)


def _where(layer_idx: int | None) -> str:
    return "" if layer_idx is None else f" (layer {layer_idx})"


def check_kv_pair(k: torch.Tensor, v: torch.Tensor, layer_idx: int | None = None) -> None:
    """Raise `CacheShapeError` unless k, v are (B, H_kv, T_new, D) tensors that agree."""
    where = _where(layer_idx)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise CacheShapeError(
            f"k and v{where} must be tensors, got {type(k).__name__}, {type(v).__name__}"
        )
    if k.dim() != 4 or v.dim() != 4:
        raise CacheShapeError(
            f"k and v{where} must be 4-D (batch, kv_heads, new_tokens, head_dim), "
            f"got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise CacheShapeError(
            f"k and v{where} must agree on (batch, kv_heads, new_tokens), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[2] < 1:
        raise CacheShapeError(f"k and v{where} carry no new tokens: shape {tuple(k.shape)}")
    if k.dtype != v.dtype or k.device != v.device:
        raise CacheDtypeError(
            f"k and v{where} must share dtype and device, got {k.dtype} on {k.device} "
            f"and {v.dtype} on {v.device}"
        )


def check_batch_index(
    indices: torch.Tensor | Sequence[int], batch: int, device: torch.device
) -> torch.Tensor:
    """Return `indices` as a 1-D long tensor on `device`; raise unless each is in [0, batch)."""
    index = torch.as_tensor(indices, device=device)
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise CacheShapeError(
            f"batch indices must be a 1-D integer tensor, got shape {tuple(index.shape)} "
            f"and dtype {index.dtype}"
        )
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
        raise CacheShapeError(
            f"batch indices must lie in [0, {batch}), got min {int(index.min())} "
            f"and max {int(index.max())}"
        )
    return index.to(torch.int64)


def check_crop(max_length: int) -> None:
    """Raise `CacheCropError` unless max_length is an int >= 0."""
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise CacheCropError(f"crop length must be an int, got {type(max_length).__name__}")
    if max_length < 0:
        raise CacheCropError(
            f"crop length must be >= 0 (keep the first n tokens), got {max_length}"
        )


class LayerMasks(list):
    """The per-layer masks of one forward: a list, one mask per known layer.

    For a cache that creates its layers on first use (layer count unknown), an index past the
    known layers returns `default`, the mask of a layer that is still empty.
    """

    def __init__(self, masks: list[torch.Tensor], default: torch.Tensor | None = None) -> None:
        super().__init__(masks)
        self.default = default

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, int) and index >= len(self) and self.default is not None:
            return self.default
        return super().__getitem__(index)


class Cache:
    """An ordered list of `CacheLayer`s: `cache.layers[i]` holds layer i's keys and values.

    Args:
        layers: the layers, one per attention layer of the model.
        layer_factory: if given, layers are created on first use by `update(k, v, i)` with
            i == len(layers), so the layer count need not be known in advance.
        device: where masks are built while the cache is empty and no attention_mask is given.
    """

    def __init__(
        self,
        layers: Sequence[CacheLayer] = (),
        *,
        layer_factory: Callable[[], CacheLayer] | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.layers: list[CacheLayer] = []
        self._layer_factory = layer_factory
        self._device = None if device is None else torch.device(device)
        for layer in layers:
            self._append(layer)

    def _append(self, layer: CacheLayer) -> CacheLayer:
        layer.layer_idx = len(self.layers)
        self.layers.append(layer)
        return layer

    def _layer(self, layer_idx: int, *, create: bool) -> CacheLayer | None:
        count = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise LayerIndexError(f"layer_idx must be an int, got {type(layer_idx).__name__}")
        if 0 <= layer_idx < count:
            return self.layers[layer_idx]
        if self._layer_factory is not None and layer_idx >= count:
            if not create:
                return None
            if layer_idx == count:
                return self._append(self._layer_factory())
            raise LayerIndexError(
                f"layer_idx {layer_idx} skips layers: this cache creates layers in order and "
                f"holds {count}, so the next new layer index is {count}"
            )
        raise LayerIndexError(
            f"layer_idx must be in [0, {count}) for this cache of {count} layers, "
            f"got {layer_idx}"
        )

    # ---- the seam -------------------------------------------------------------------------
    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D) for `layer_idx`; return K, V (B, H_kv, T_visible, D)."""
        layer = self._layer(layer_idx, create=True)
        assert layer is not None
        return layer.update(k, v)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far by layer `layer_idx` (0 for a layer not created yet)."""
        layer = self._layer(layer_idx, create=False)
        return 0 if layer is None else layer.get_seq_length()

    def attention_masks(
        self,
        new_tokens: int,
        attention_mask: torch.Tensor | None = None,
        *,
        device: torch.device | str | None = None,
    ) -> list[torch.Tensor]:
        """One boolean mask per layer for the next forward of `new_tokens` tokens.

        Call before that forward's `update` calls. Mask i has shape (B or 1, 1, new_tokens,
        T_kv_i), True = may attend, where T_kv_i is the length of K that `update` returns on
        layer i; query j sits at absolute position past + j, past = get_seq_length(i).

        Args:
            new_tokens: tokens in this forward's chunk (>= 1).
            attention_mask: optional (B, past + new_tokens), 1 = real token, 0 = padding.
            device: where to build masks while the cache is empty and no attention_mask is
                given (default: the cache's `device`, else CPU).
        """
        check_new_tokens(new_tokens)
        fallback = _fallback_device(attention_mask, device, self._device)
        shared: dict[Hashable, torch.Tensor] = {}
        masks = [
            self._mask_for(layer, new_tokens, attention_mask, fallback, shared)
            for layer in self.layers
        ]
        default = None
        if self._layer_factory is not None:
            default = self._mask_for(
                self._layer_factory(), new_tokens, attention_mask, fallback, shared
            )
        return LayerMasks(masks, default)

    @staticmethod
    def _mask_for(
        layer: CacheLayer,
        new_tokens: int,
        attention_mask: torch.Tensor | None,
        fallback: torch.device,
        shared: dict[Hashable, torch.Tensor],
    ) -> torch.Tensor:
        key = (layer.mask_key(new_tokens), layer.window)
        mask = shared.get(key)
        if mask is None:
            if attention_mask is not None and not is_compiling():
                check_attention_mask(attention_mask, layer, new_tokens)
            device = layer.device or fallback
            query_positions, key_positions = layer.mask_positions(new_tokens, device)
            if attention_mask is not None:
                attention_mask = attention_mask.to(device)
            mask = build_mask(
                query_positions,
                key_positions,
                window=layer.window,
                attention_mask=attention_mask,
            )
            shared[key] = mask
        return mask

    # ---- whole-cache operations -------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens of every layer (speculative-decoding rollback)."""
        check_crop(max_length)
        for layer in self.layers:  # all or nothing: check every layer before changing one
            layer.validate_crop(max_length)
        for layer in self.layers:
            layer.crop(max_length)

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep batch rows `indices` (1-D, in that order) in every layer."""
        for layer in self.layers:  # all or nothing
            if layer.batch_size is not None and layer.device is not None:
                check_batch_index(indices, layer.batch_size, layer.device)
        for layer in self.layers:
            layer.select(indices)

    def reorder(self, beam_idx: torch.Tensor | Sequence[int]) -> None:
        """Reorder the batch by `beam_idx` (1-D, same length as the batch), as beam search does."""
        for layer in self.layers:
            batch = layer.batch_size
            if batch is not None and len(beam_idx) != batch:
                raise CacheShapeError(
                    f"beam_idx must have one entry per batch row ({batch}), got {len(beam_idx)}; "
                    f"use select() to change the batch size"
                )
        self.select(beam_idx)

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times (B → B × repeats) in every layer."""
        for layer in self.layers:
            layer.repeat_interleave(repeats)

    def reset(self) -> None:
        """Forget every token in every layer; storage is kept for reuse."""
        for layer in self.layers:
            layer.reset()

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values over all layers."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def nbytes_used(self) -> int:
        """Bytes of the rows holding live tokens over all layers."""
        return sum(layer.nbytes_used for layer in self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __repr__(self) -> str:
        kinds = ", ".join(type(layer).__name__ for layer in self.layers[:4])
        more = ", …" if len(self.layers) > 4 else ""
        return (
            f"{type(self).__name__}({len(self.layers)} layers [{kinds}{more}], "
            f"seq_length={self.get_seq_length() if self.layers else 0})"
        )


def check_new_tokens(new_tokens: int) -> None:
    """Raise `CacheShapeError` unless new_tokens is an int >= 1."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise CacheShapeError(f"new_tokens must be an int >= 1, got {new_tokens!r}")


def check_attention_mask(attention_mask: torch.Tensor, layer: CacheLayer, new_tokens: int) -> None:
    """Raise `CacheShapeError` unless attention_mask is (B, past + new_tokens) for `layer`."""
    past = layer.get_seq_length()
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() != 2 or shape[1] != past + new_tokens:
        raise CacheShapeError(
            f"attention_mask must be (batch, past + new_tokens) = (batch, {past + new_tokens}) "
            f"with past={past}{_where(layer.layer_idx)}, got shape {shape}"
        )
    batch = layer.batch_size
    if batch is not None and shape[0] != batch:
        raise CacheShapeError(
            f"attention_mask has batch {shape[0]}; the cache holds batch {batch}"
            f"{_where(layer.layer_idx)}"
        )


def _fallback_device(
    attention_mask: torch.Tensor | None,
    device: torch.device | str | None,
    cache_device: torch.device | None,
) -> torch.device:
    if attention_mask is not None:
        return attention_mask.device
    if device is not None:
        return torch.device(device)
    return cache_device or torch.device("cpu")
