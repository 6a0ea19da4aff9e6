"""TransformersCache: a kvcache cache speaking transformers' cache protocol.

A transformers model builds its masks itself before the layers run: it asks the cache, for the
first layer of each attention type, where the keys that `update` will return sit
(`get_mask_sizes(query_length, layer_idx)` -> (kv_length, kv_offset): keys at absolute positions
kv_offset .. kv_offset + kv_length - 1, in that order; slots past the newest token are hidden by
causality) and masks padding from its own attention_mask, whose columns are every token the
cache has stored. So the adapter stores every column (padding too) and makes each kvcache
layer's keys come back in position order: the layer says, before its update, at which
positions the rows it will return sit (`CacheLayer.mask_positions`), and rows that come back
out of order (a sliding ring after it wrapped) are put in order.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

from kvcache.cache import Cache as KVCache
from kvcache.cache import CacheLayer, CacheShapeError, NoCache

from .version import require_transformers

transformers = require_transformers()
_HFCache = transformers.cache_utils.Cache
_HFLayer = transformers.cache_utils.CacheLayerMixin

# (kv_offset, kv_length, order): keys at kv_offset .. kv_offset + kv_length - 1 once the
# returned rows are taken in `order` ((T_kv,) long index), None = already in order
Layout = tuple[int, int, "torch.Tensor | None"]


def key_layout(layer: CacheLayer, new_tokens: int, device: torch.device | str | None) -> Layout:
    """Where the keys of `layer`'s next update of `new_tokens` rows sit, asked before it."""
    _, key_positions = layer.mask_positions(new_tokens, device)  # (T_kv,), -1 = no token
    positions = key_positions.tolist()
    held = [position for position in positions if position >= 0]
    if not held:
        return 0, len(positions), None
    first = held[0]
    in_order = positions[: len(held)] == list(range(first, first + len(held)))
    if in_order and all(position < 0 for position in positions[len(held) :]):
        return first, len(positions), None  # trailing empty slots: past the newest, hidden
    order = sorted((p, i) for i, p in enumerate(positions) if p >= 0)
    lowest = order[0][0]
    if [p for p, _ in order] != list(range(lowest, lowest + len(order))):
        raise CacheShapeError(
            f"layer {layer.layer_idx} would return keys at positions with gaps "
            f"({[p for p, _ in order][:8]}…); a transformers model needs consecutive positions"
        )
    index = torch.tensor([i for _, i in order], dtype=torch.long, device=key_positions.device)
    return lowest, len(order), index


class _LayerView(_HFLayer):
    """Layer `index` of a TransformersCache, as transformers' `CacheLayerMixin` sees it."""

    is_compileable = False
    supports_early_init = False  # kvcache layers allocate from the first update's k, v

    def __init__(self, owner: TransformersCache, index: int) -> None:  # no base init: no tensors of its own
        self._owner = owner
        self._index = index

    @property
    def layer(self) -> CacheLayer:
        """The kvcache layer behind this view."""
        return self._owner.kvcache.layers[self._index]

    @property
    def keys(self) -> torch.Tensor | None:
        """The visible keys (B, H_kv, T, D) in position order."""
        return self.layer.keys

    @property
    def values(self) -> torch.Tensor | None:
        """The visible values (B, H_kv, T, D_v) in position order."""
        return self.layer.values

    @property
    def is_sliding(self) -> bool:
        return self.layer.window is not None

    @property
    def is_croppable(self) -> bool:
        return self.layer.window is None

    @property
    def is_initialized(self) -> bool:
        return self.layer.device is not None

    @property
    def device(self) -> torch.device | None:
        return self.layer.device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing: the kvcache layer allocates on its first update."""

    def update(self, key_states, value_states, *args, **kwargs):
        """The owner's `update` for this layer."""
        return self._owner.update(key_states, value_states, self._index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._owner.get_mask_sizes(query_length, self._index)

    def get_seq_length(self) -> int:
        return self.layer.get_seq_length()

    def get_max_length(self) -> int:
        """Tokens the layer can hold: its capacity where it has one (static), else -1."""
        layer = self.layer
        return layer.window or getattr(layer, "max_cache_len", -1)

    def reset(self) -> None:
        self.layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        self.layer.crop(self.layer.get_seq_length() - _tokens_to_remove(tokens_to_remove))

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.layer.select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.layer.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.layer.select(indices)

    def __repr__(self) -> str:
        return f"_LayerView({type(self.layer).__name__})"


def _tokens_to_remove(tokens_to_remove: int) -> int:
    """transformers' crop argument (0 or negative: remove that many) as a count."""
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int) or tokens_to_remove > 0:
        raise ValueError(
            f"crop takes 0 or a negative int (the number of tokens to remove, as transformers' "
            f"caches do), got {tokens_to_remove!r}"
        )
    return -tokens_to_remove


class TransformersCache(_HFCache):
    """A kvcache cache (`.kvcache`) as a transformers `Cache`: pass it as `past_key_values=` (or
    `cache=`) to a transformers model's forward or `generate`. Every column of the model's
    attention_mask is stored, padding too (the model's own mask hides it).

    Args:
        cache: any kvcache cache (dynamic, static, sliding, quantized, paged, …).
    """

    def __init__(self, cache: KVCache) -> None:  # the base's init would make its own layers
        if not isinstance(cache, KVCache):
            raise TypeError(
                f"TransformersCache wraps a kvcache cache (kvcache.cache.Cache), got "
                f"{type(cache).__name__}; for a transformers cache use kvcache.hf.from_transformers"
            )
        if isinstance(cache, NoCache):
            raise TypeError(
                "a NoCache keeps no keys or values, so a transformers model handed one would lose "
                "its context after the first forward; run the transformers model with "
                "use_cache=False instead"
            )
        self.kvcache = cache
        self.layer_class_to_replicate = None
        self.offloading = False
        self._views: list[_LayerView] = []
        self._layouts: dict[Hashable, Layout] = {}

    @property
    def layers(self) -> list[_LayerView]:  # type: ignore[override]
        """One view per kvcache layer (a cache that creates layers on first use grows here too)."""
        while len(self._views) < len(self.kvcache.layers):
            self._views.append(_LayerView(self, len(self._views)))
        return self._views

    def _layout(self, layer: CacheLayer, new_tokens: int, device) -> Layout:
        key = (type(layer), layer.window, layer.mask_key(new_tokens))
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) > 64:  # keys carry lengths: old forwards' never match again
                self._layouts.clear()
            layout = self._layouts[key] = key_layout(layer, new_tokens, device)
        return layout

    # ---- what transformers asks ----------------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """Store k, v (B, H_kv, T_new, D) in layer `layer_idx`; return K, V (B, H_kv, T_kv, D)
        at the positions `get_mask_sizes` gave, in order."""
        cache = self.kvcache
        order = None
        if layer_idx < len(cache.layers):  # a layer created by this update returns the new rows
            order = self._layout(cache.layers[layer_idx], key_states.shape[2], key_states.device)[2]
        keys, values = cache.update(key_states, value_states, layer_idx)
        if order is not None:
            order = order.to(keys.device)
            keys, values = keys.index_select(2, order), values.index_select(2, order)
        return keys, values

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys layer `layer_idx`'s next update returns."""
        cache = self.kvcache
        if layer_idx >= len(cache.layers):
            return query_length, 0
        layer = cache.layers[layer_idx]
        offset, length, _ = self._layout(layer, query_length, layer.device)
        return length, offset

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens (columns, padding included) layer `layer_idx` has seen."""
        return self.kvcache.get_seq_length(layer_idx) if layer_idx < len(self.kvcache.layers) else 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    @property
    def batch_size(self) -> int:
        """Rows held, or -1 before the first update."""
        sizes = {layer.batch_size for layer in self.kvcache.layers} - {None}
        return sizes.pop() if len(sizes) == 1 else -1

    # ---- whole-cache operations: kvcache's, all or nothing ----------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last -tokens_to_remove tokens (transformers' convention: 0 or negative)."""
        remove = _tokens_to_remove(tokens_to_remove)
        if remove:
            self.kvcache.crop(max(0, self.get_seq_length() - remove))

    def reset(self) -> None:
        self.kvcache.reset()
        self._layouts.clear()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.kvcache.reorder(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.kvcache.repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.kvcache.select(indices)

    def __repr__(self) -> str:
        return f"TransformersCache({self.kvcache!r})"
