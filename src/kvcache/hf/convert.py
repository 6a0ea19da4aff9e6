"""Moving a conversation's cache between kvcache and transformers.

`to_transformers(cache)` wraps a kvcache cache (no copy); `from_transformers(hf_cache)` copies
the rows of a transformers cache filled by a transformers model into kvcache layers of the same
kinds, at the same absolute positions (a sliding layer holds only its last window - 1 rows, but
counts every token seen), so either model continues where the other stopped.
"""

from __future__ import annotations

import torch

from kvcache.cache import Cache, CacheLayer, DynamicLayer, SlidingWindowLayer, StaticLayer

from .adapter import TransformersCache, transformers

_hf = transformers.cache_utils


class CacheConversionError(TypeError):
    """A transformers cache (or layer) kind that kvcache has no counterpart for."""


def to_transformers(cache: Cache | TransformersCache) -> TransformersCache:
    """What a transformers model accepts as `past_key_values=` / `cache=` for kvcache `cache`:
    a `TransformersCache` over it (the same object back if it already is one). The cache is
    shared, not copied: updates through either are seen by both."""
    if isinstance(cache, TransformersCache):
        return cache
    return TransformersCache(cache)


def from_transformers(hf_cache) -> Cache:
    """A kvcache cache holding what transformers cache `hf_cache` holds, to continue in a kvcache
    model: its dynamic and static layers as `DynamicLayer`/`StaticLayer`s, its sliding layers as
    `SlidingWindowLayer`s of their window, every layer at the length transformers counts. A
    `TransformersCache` gives back its kvcache cache (no copy). The rows are copied.

    Raises `CacheConversionError` for kinds with no counterpart (quantized, offloaded, linear
    attention or encoder-decoder caches)."""
    if isinstance(hf_cache, TransformersCache):
        return hf_cache.kvcache
    if not isinstance(hf_cache, _hf.Cache):
        raise CacheConversionError(
            f"from_transformers takes a transformers Cache, got {type(hf_cache).__name__}; "
            f"a kvcache cache needs no conversion"
        )
    if getattr(hf_cache, "offloading", False):
        raise CacheConversionError("from_transformers does not take an offloaded cache (offloading=True)")
    return Cache([_layer(layer, index) for index, layer in enumerate(hf_cache.layers)])


def _layer(layer, index: int) -> CacheLayer:
    """One transformers layer's rows in a kvcache layer of the same kind."""
    kind = type(layer)
    if not issubclass(kind, _hf.CacheLayerMixin) or issubclass(
        kind, (_hf.BaseQuantizedLayer, _hf.LinearAttentionCacheLayerMixin)
    ) or kind.__name__.endswith("IndexedLayer"):
        raise CacheConversionError(
            f"layer {index} is a transformers {kind.__name__}, which kvcache has no counterpart "
            f"for; from_transformers reads DynamicLayer, DynamicSlidingWindowLayer, StaticLayer "
            f"and StaticSlidingWindowLayer"
        )
    seen = int(layer.get_seq_length())  # tokens seen: a sliding layer counts the evicted ones
    keys, values = layer.keys, layer.values
    if issubclass(kind, _hf.StaticSlidingWindowLayer):  # in order: slots 0.. until full, then rolled
        target = SlidingWindowLayer(layer.max_cache_len)
        held = min(seen, layer.max_cache_len)
        if held:
            target.load_recent(keys[:, :, :held], values[:, :, :held], seen)
        return target
    if issubclass(kind, _hf.DynamicSlidingWindowLayer):
        target = SlidingWindowLayer(layer.sliding_window)
        if seen:
            target.load_recent(keys, values, seen)
        return target
    if issubclass(kind, _hf.StaticLayer):  # the whole buffer; rows past the length are stale
        target = StaticLayer(layer.max_cache_len)
        if seen:
            target.update(keys[:, :, :seen], values[:, :, :seen])
        return target
    if not issubclass(kind, _hf.DynamicLayer):
        raise CacheConversionError(
            f"layer {index} is a transformers {kind.__name__}, not a kind kvcache reads"
        )
    target = DynamicLayer()
    if seen:
        target.update(torch.as_tensor(keys), torch.as_tensor(values))
    return target
