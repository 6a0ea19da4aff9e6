"""Block bookkeeping of the paged cache in plain Python (no torch in its code): which block of a
pool holds what, for each sequence.

`BlockAllocator` (`allocator`): block tables, reference counts, prefix hashes chained from a root,
copy on write, the cached blocks evicted least recently freed first, pins. `WindowedBlockAllocator`
(`window`): the same for sliding-window layers, giving back the blocks a window has passed. The
tensors the blocks index live in `kvcache.cache.paged`; the engine's pool and the KV-store tiers
read the hashes.
"""

from .allocator import (
    HOLE,
    ROOT_HASH,
    BlockAllocator,
    BlockListener,
    SequenceBlocks,
    block_hash,
    prefix_digests,
    salt_root,
)
from .window import WindowedBlockAllocator

__all__ = [
    "HOLE", "ROOT_HASH", "BlockAllocator", "BlockListener", "SequenceBlocks", "WindowedBlockAllocator",
    "block_hash", "prefix_digests", "salt_root",
]
