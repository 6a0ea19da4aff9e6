"""Handing the C heap's free pages back to the operating system after large buffers are freed."""

from __future__ import annotations

import ctypes


def release_freed_memory() -> None:
    """Return the C heap's free pages to the OS (glibc's malloc_trim; elsewhere nothing).

    Freed tensors smaller than glibc's (adaptive, up to 32 MB) mmap threshold stay in the heap
    and in the process's resident memory; after a checkpoint is read into tensors, or weights are
    re-laid out, that is a copy's worth of memory the process no longer uses."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return
    trim(0)
