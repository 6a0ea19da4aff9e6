"""The weights a CPU decode step streams, moved into one block of memory on 2 MB pages.

Why: a decode step reads every weight once, and with 4 KB pages that is one TLB entry per 4 KB.
On the machine measured, cycling matrix-vector products over 4 KB-paged weights slowed from
~25 GB/s to ~7 GB/s once they passed 8 MB (the reach of a 2048-entry second-level TLB), while
the same 8 MB on 2 MB pages kept ~26 GB/s (12 MB: 5.5 against 9.2 GB/s). So
`move_weights_to_huge_pages` copies the parameters, in module order (the order a step reads
them), into one anonymous mapping aligned to 2 MB and advised MADV_HUGEPAGE (Linux transparent
huge pages in "always" or "madvise" mode), and points every parameter and fused weight at its
copy: same names, shapes, strides, values and Parameter objects; only the memory moves. In a
whole decode step it gained 5.6 % on the ~3M model and 2.5 % on the ~100M one (medians), so only
models up to MOVE_LIMIT bytes move. Elsewhere it does nothing.
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20  # bytes
#: models with more weight bytes than this stay where they are: the move is a copy (~0.5 s for
#: the ~100M model's 500 MB here) and gains them less (~2.5 % a decode step against ~5.6 % for
#: the ~3M one), so it would pay off only after ~1000 tokens; the ~3M model moves in ~20 ms
MOVE_LIMIT = 64 << 20  # bytes
ALIGN = 64  # bytes between two tensors' storages (a cache line)
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


def huge_page_block(nbytes: int):
    """A (nbytes,) uint8 numpy array whose memory starts on a 2 MB boundary of a private
    anonymous mapping advised MADV_HUGEPAGE. The mapping lives as long as an array or tensor
    viewing it (each holds the mapping's buffer)."""
    import numpy as np

    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, dtype=np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE
    return whole[start : start + nbytes]


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def release_freed_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc's malloc_trim; elsewhere nothing).

    Freed tensors smaller than glibc's (adaptive, up to 32 MB) mmap threshold stay in the heap
    and in the process's resident memory; after the weights move, that was ~200 MB for the
    ~100M model."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)


def _weight_slots(model) -> list[tuple[object, str, torch.Tensor]]:
    """(owner, attribute, tensor) for every parameter (each Parameter once) and every fused
    weight and bias, in module order."""
    slots: list[tuple[object, str, torch.Tensor]] = []
    seen: set[int] = set()
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None and id(parameter) not in seen:
                seen.add(id(parameter))
                slots.append((parameter, "data", parameter))
        for fused_name in ("fused_qkv", "fused_gate_up"):
            fused = module.__dict__.get(fused_name)
            if fused is not None:
                slots.append((fused, "weight", fused.weight))
                if fused.bias is not None:
                    slots.append((fused, "bias", fused.bias))
    return slots


def move_weights_to_huge_pages(model, limit: int = MOVE_LIMIT) -> bool:
    """Move every CPU parameter and fused weight of `model` into one huge-page block (see the
    module docstring). Returns whether it moved them (False: no huge pages here, a weight not
    on CPU, or more than `limit` bytes of weights). Storages move one at a time and each old
    one is handed back to the OS before the next is copied, so peak memory stays the model's
    plus one storage."""
    slots = _weight_slots(model)
    if not slots or not huge_pages_available():
        return False
    if any(tensor.device.type != "cpu" for _, _, tensor in slots):
        return False
    stored = {slot[2].untyped_storage().data_ptr(): slot[2].untyped_storage().nbytes() for slot in slots}
    if sum(stored.values()) > limit:
        return False
    groups: dict[int, list[tuple[object, str, torch.Tensor]]] = {}  # by storage, first-use order
    sizes: dict[int, int] = {}
    for slot in slots:
        storage = slot[2].untyped_storage()
        groups.setdefault(storage.data_ptr(), []).append(slot)
        sizes[storage.data_ptr()] = storage.nbytes()
    del slots, storage
    block = huge_page_block(sum(_aligned(size) for size in sizes.values()))
    model.forget_numpy_step()  # its views would keep every old storage alive until it is rebuilt
    start = 0
    with torch.no_grad():
        for pointer in list(groups):
            group = groups.pop(pointer)  # the last references to the old storage go with it
            # each old storage gets its own storage over its slice of the block, so tensors that
            # shared one still do and no others (FusedLinear.is_intact compares storages)
            target = torch.from_numpy(block[start : start + sizes[pointer]])
            old = torch.empty(0, dtype=torch.uint8, device="cpu").set_(group[0][2].untyped_storage())
            target.copy_(old)
            for owner, attribute, tensor in group:
                moved = torch.empty(0, dtype=tensor.dtype, device="cpu")
                moved.set_(target.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
                setattr(owner, attribute, moved)
            del group, tensor, old
            release_freed_memory()  # so the old storage leaves resident memory before the next
            start += _aligned(sizes[pointer])
    return True
