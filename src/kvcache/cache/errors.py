"""Named errors raised by the cache layers.

Every error says what was expected and what was given. All subclass `CacheError`, itself a
`ValueError`, so callers can catch the family or one precise case.
"""

from __future__ import annotations

from kvcache.blocks.errors import (  # the errors the block pool raises too, defined with it
    CacheConfigError,
    CacheCropError,
    CacheError,
    OutOfBlocksError,
    UnknownSequenceError,
)

__all__ = [
    "CacheConfigError", "CacheCropError", "CacheDeviceError", "CacheDtypeError", "CacheError",
    "CacheOverflowError", "CacheShapeError", "CacheStateError", "LayerIndexError", "OutOfBlocksError",
    "UnknownSequenceError",
]


class CacheShapeError(CacheError):
    """k/v of the wrong rank, or a batch/head/dim size that differs from what is stored."""


class CacheDtypeError(CacheError):
    """k/v whose dtype differs from the dtype the cache stores."""


class CacheDeviceError(CacheError):
    """k/v on a different device than the cache's tensors."""


class LayerIndexError(CacheError, IndexError):
    """A layer index outside the cache's layers (also an IndexError, as for a list)."""


class CacheStateError(CacheError):
    """A cache left inconsistent (layers at different lengths after a forward that failed
    between layers): refused until `crop` or `reset` puts it right."""


class CacheOverflowError(CacheError):
    """More tokens than a fixed-capacity (static) layer can hold."""

    def __init__(self, capacity: int, requested: int, layer_idx: int | None = None) -> None:
        where = "" if layer_idx is None else f" (layer {layer_idx})"
        super().__init__(
            f"static cache overflow{where}: capacity is {capacity} tokens, "
            f"requested length is {requested} tokens; create the cache with a larger "
            f"max_cache_len, or use a dynamic or sliding cache"
        )
        self.capacity = capacity
        self.requested = requested
        self.layer_idx = layer_idx
