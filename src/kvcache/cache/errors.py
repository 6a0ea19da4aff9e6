"""Named errors raised by the cache layers.

Every error says what was expected and what was given. All subclass `CacheError`, itself a
`ValueError`, so callers can catch the family or one precise case.
"""

from __future__ import annotations


class CacheError(ValueError):
    """Base class of every error raised by `kvcache.cache`."""


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


class CacheCropError(CacheError):
    """A negative crop, or a crop further back than a sliding window can restore."""


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


class CacheConfigError(CacheError):
    """Contradictory or missing sizes when building a cache (from a config or by hand)."""


class OutOfBlocksError(CacheError):
    """The pool cannot supply the blocks asked for; nothing was changed."""

    def __init__(self, requested: int, available: int, num_blocks: int) -> None:
        super().__init__(
            f"paged cache out of blocks: {requested} more block(s) needed, {available} available "
            f"(free or cached) of {num_blocks}; free finished sequences, or build the cache with "
            f"more blocks"
        )
        self.requested = requested
        self.available = available
        self.num_blocks = num_blocks


class UnknownSequenceError(CacheError, KeyError):
    """A sequence id the allocator does not hold (or one that it already holds, when adding)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])
