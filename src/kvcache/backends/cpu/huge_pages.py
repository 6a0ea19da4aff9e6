"""Memory on 2 MB pages for the weights a CPU decode step streams.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
huge_pages.py.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import torch

from kvcache.model.heap import release_freed_memory

HUGE_PAGE = 2 << 20  # bytes
#: weight bytes up to which a model is packed onto huge pages
MOVE_LIMIT = 4 << 30
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
    """float32 arrays (or raw bytes) carved in order out of one huge-page block of `nbytes`
    (the sum of `aligned(array bytes)` over the arrays to come)."""

    def __init__(self, nbytes: int) -> None:
        self.block = huge_page_block(nbytes)
        self.offset = 0

    def array(self, shape: tuple[int, ...]) -> np.ndarray:
        """The next (shape) float32 array of the block, C-contiguous and uninitialised."""
        return self.bytes(int(np.prod(shape)) * 4).view(np.float32).reshape(shape)

    def bytes(self, size: int) -> np.ndarray:
        """The next `size` bytes of the block, (size,) uint8, uninitialised; the next array
        starts ALIGN-aligned after them."""
        if self.offset + size > len(self.block):
            raise ValueError(f"the arena holds {len(self.block)} bytes; {self.offset + size} asked")
        out = self.block[self.offset : self.offset + size]
        self.offset += aligned(size)
        return out


def move_parameters(module: torch.nn.Module) -> bool:
    """Move every parameter of `module` (a CPU model's, contiguous or not) into one huge-page
    block, each pointed at its copy (same values, dtype, shape and Parameter object; tied ones
    stay tied), when huge pages are available and the parameters' bytes are at most MOVE_LIMIT.
    Returns whether they moved. An in-place write to a parameter is then a write to the block."""
    parameters = list({id(p): p for p in module.parameters()}.values())
    total = sum(aligned(p.numel() * p.element_size()) for p in parameters)
    if not huge_pages_available() or total > MOVE_LIMIT or any(p.device.type != "cpu" for p in parameters):
        return False
    arena = Arena(total)
    with torch.no_grad():
        for parameter in parameters:
            memory = torch.from_numpy(arena.bytes(parameter.numel() * parameter.element_size()))
            moved = memory.view(parameter.dtype).view(parameter.shape)
            moved.copy_(parameter.detach())
            parameter.data = moved
    release_freed_memory()  # the old storages' pages
    return True
