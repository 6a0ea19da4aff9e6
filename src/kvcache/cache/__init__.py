"""KV cache layers on PyTorch tensors behind one seam (`Cache.update`, `attention_masks`).

    cache = make_cache("dynamic", config=model_config)
    masks = cache.attention_masks(new_tokens, attention_mask)   # once per forward
    K, V = cache.update(k, v, layer_idx)                        # once per layer

Kinds: `DynamicLayer` (grows, amortised O(1) append), `StaticLayer` (preallocated,
torch.compile friendly), `SlidingWindowLayer` (ring of the last W positions), `QuantizedLayer`
(int8/int4/fp8 groups + a full-precision residual); `NoCache` keeps nothing; `PagedCache`
keeps blocks of a shared pool (prefix reuse, forks).
"""

from .base import Cache, CacheLayer, LayerMasks
from .dynamic import DynamicCache, DynamicLayer
from .errors import (
    CacheConfigError,
    CacheCropError,
    CacheDeviceError,
    CacheDtypeError,
    CacheError,
    CacheOverflowError,
    CacheShapeError,
    LayerIndexError,
)
from .factory import make_cache
from .masks import build_mask
from .nocache import NoCache
from .paged import OutOfBlocksError, PagedCache, PagedLayer
from .quantized import QuantizedCache, QuantizedLayer
from .sliding import SlidingWindowCache, SlidingWindowLayer
from .static import StaticCache, StaticLayer

__all__ = [
    "Cache",
    "CacheConfigError",
    "CacheCropError",
    "CacheDeviceError",
    "CacheDtypeError",
    "CacheError",
    "CacheLayer",
    "CacheOverflowError",
    "CacheShapeError",
    "DynamicCache",
    "DynamicLayer",
    "LayerIndexError",
    "LayerMasks",
    "NoCache",
    "OutOfBlocksError",
    "PagedCache",
    "PagedLayer",
    "QuantizedCache",
    "QuantizedLayer",
    "SlidingWindowCache",
    "SlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "build_mask",
    "make_cache",
]
