"""kvcache caches inside Hugging Face transformers models, and back.

    from kvcache.hf import DynamicCache                     # the guide's loop, import swapped
    past_key_values = DynamicCache(config=model.config)     # model: a transformers model
    outputs = model(**inputs, past_key_values=past_key_values, use_cache=True)

    hf_cache = to_transformers(kvcache_cache)               # any kvcache cache, wrapped
    model.generate(input_ids, past_key_values=hf_cache)     # (or cache=hf_cache)
    kvcache_cache = from_transformers(transformers_cache)   # rows copied, positions kept

Importing this module imports transformers and checks its version (`SUPPORTED`);
`import kvcache` never does. See docs/transformers.md.
"""

from .version import SUPPORTED, TransformersVersionError  # noqa: I001  (checked first)
from .adapter import TransformersCache
from .caches import DynamicCache, PagedCache, QuantizedCache, SlidingWindowCache, StaticCache
from .convert import CacheConversionError, from_transformers, to_transformers

__all__ = [
    "SUPPORTED",
    "CacheConversionError",
    "DynamicCache",
    "PagedCache",
    "QuantizedCache",
    "SlidingWindowCache",
    "StaticCache",
    "TransformersCache",
    "TransformersVersionError",
    "from_transformers",
    "to_transformers",
]
