"""Memory on 2 MB pages for the weights a CPU decode step streams.

Why: a decode step reads every weight once, and with 4 KB pages that is one TLB entry per 4 KB.
Cycling matrix-vector products over weights past the reach of the second-level TLB (8 MB of
4 KB pages) slows them several-fold, while the same bytes on 2 MB pages keep their speed
(`docs/backends.md` has the measurements). So the numpy backend packs a small model's weights
into one anonymous mapping aligned to 2 MB and advised MADV_HUGEPAGE (Linux transparent huge
pages in "always" or "madvise" mode). Larger models (over MOVE_LIMIT bytes) keep ordinary
allocations: the copy costs them more than the pages gain.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20  # bytes
#: weight bytes up to which a model is packed onto huge pages
MOVE_LIMIT = 64 << 20
ALIGN = 64  # bytes between two arrays (a cache line)
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether anonymous memory can be advised onto transparent huge pages here."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or not hasattr(mmap, "MAP_ANONYMOUS"):
        return False
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_block(nbytes: int) -> np.ndarray:
    """A (nbytes,) uint8 array whose memory starts on a 2 MB boundary of a private anonymous
    mapping advised MADV_HUGEPAGE. The mapping lives as long as an array or tensor viewing it."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    return whole[start : start + nbytes]


def aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of ALIGN."""
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """float32 arrays carved in order out of one huge-page block of `nbytes` (the sum of
    `aligned(array bytes)` over the arrays to come)."""

    def __init__(self, nbytes: int) -> None:
        self.block = huge_page_block(nbytes)
        self.offset = 0

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next (shape) float32 array of the block, C-contiguous and uninitialised."""
        count = int(np.prod(shape))
        size = count * 4
        if self.offset + size > len(self.block):
            raise ValueError(f"the arena holds {len(self.block)} bytes; {self.offset + size} asked")
        out = self.block[self.offset : self.offset + size].view(np.float32).reshape(shape)
        self.offset += aligned(size)
        return out
