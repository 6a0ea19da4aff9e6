"""KV cache layers on PyTorch tensors behind one seam (`Cache.begin`, `Cache.update`).

    cache = make_cache("dynamic", config=model_config)
    plan = cache.begin(new_tokens, attention_mask)              # once per forward
    K, V = cache.update(k, v, layer_idx)                        # once per layer

Kinds: `DynamicLayer` (grows, amortised O(1) append), `StaticLayer` (preallocated),
`SlidingWindowLayer` (ring of the last W positions), their torch.compile twins
`CompiledStaticLayer` and `CompiledSlidingWindowLayer`, `QuantizedLayer` (int8/int4/fp8 groups +
a full-precision residual); `NoCache` keeps nothing; `PagedCache` keeps blocks of a shared pool
(prefix reuse, forks, rows at their own lengths).
"""

from .base import Cache, CacheLayer, ForwardPlan, LayerMasks
from .dynamic import DynamicCache, DynamicLayer
from .errors import (
    CacheConfigError,
    CacheCropError,
    CacheDeviceError,
    CacheDtypeError,
    CacheError,
    CacheOverflowError,
    CacheShapeError,
    CacheStateError,
    LayerIndexError,
)
from .factory import make_cache
from .masks import build_mask
from .nocache import NoCache
from .paged import OutOfBlocksError, PagedBatch, PagedCache, PagedLayer, RowState
from .quantized import QuantizedCache, QuantizedLayer
from .sliding import CompiledSlidingWindowLayer, SlidingWindowCache, SlidingWindowLayer
from .static import CompiledStaticLayer, StaticCache, StaticLayer

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
    "CacheStateError",
    "CompiledSlidingWindowLayer",
    "CompiledStaticLayer",
    "DynamicCache",
    "DynamicLayer",
    "ForwardPlan",
    "LayerIndexError",
    "LayerMasks",
    "NoCache",
    "OutOfBlocksError",
    "PagedBatch",
    "PagedCache",
    "PagedLayer",
    "QuantizedCache",
    "QuantizedLayer",
    "RowState",
    "SlidingWindowCache",
    "SlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "build_mask",
    "make_cache",
]
