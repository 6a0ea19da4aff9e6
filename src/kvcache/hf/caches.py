"""kvcache's cache kinds under the names transformers users know, as transformers caches.

`kvcache.hf.DynamicCache(config=model.config)` is `TransformersCache(kvcache.DynamicCache(
config=model.config))`: the same arguments as the kvcache class of that name, the result ready
for `past_key_values=` (the kvcache cache itself is `.kvcache`). So the caching guide's loop runs
with only its import changed.
"""

from __future__ import annotations

from kvcache import cache as kv

from .adapter import TransformersCache


class DynamicCache(TransformersCache):
    """`kvcache.DynamicCache(*args, **kwargs)` as a transformers cache (grows with the sequence;
    a config's sliding layers get a ring of the window)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(kv.DynamicCache(*args, **kwargs))


class StaticCache(TransformersCache):
    """`kvcache.StaticCache(*args, **kwargs)` as a transformers cache (preallocated)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(kv.StaticCache(*args, **kwargs))


class SlidingWindowCache(TransformersCache):
    """`kvcache.SlidingWindowCache(*args, **kwargs)` as a transformers cache (every layer a
    ring of the last `window` positions)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(kv.SlidingWindowCache(*args, **kwargs))


class QuantizedCache(TransformersCache):
    """`kvcache.QuantizedCache(*args, **kwargs)` as a transformers cache (int8/int4/fp8 groups
    and a full-precision residual; returns dequantized keys and values)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(kv.QuantizedCache(*args, **kwargs))


class PagedCache(TransformersCache):
    """`kvcache.PagedCache(*args, **kwargs)` as a transformers cache (blocks of a pool; prefix
    blocks reused through `.kvcache.add_sequence(prompt_ids)` before `generate`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(kv.PagedCache(*args, **kwargs))
