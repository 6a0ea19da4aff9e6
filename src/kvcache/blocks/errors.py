"""The errors the block pool raises, and their base `CacheError` (a `ValueError`), the base of every
error of `kvcache.cache` too: defined here, in the lowest layer that raises them, so the block
bookkeeping imports nothing above it (`kvcache.cache.errors` lists them with the rest).
"""

from __future__ import annotations


class CacheError(ValueError):
    """Base class of every error raised by `kvcache.cache`."""


class CacheCropError(CacheError):
    """A negative crop, or a crop further back than a sliding window can restore."""


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
