"""torch's CPU thread count, set for a block and restored."""

from __future__ import annotations

import torch


class torch_threads:  # noqa: N801 (used as a function: `with torch_threads(1): ...`)
    """Run the block with `threads` torch CPU threads (None: leave as is), then restore.
    A class, not a generator-based context manager: it wraps every decode step."""

    __slots__ = ("threads", "before")

    def __init__(self, threads: int | None) -> None:
        self.threads = threads
        self.before = 0

    def __enter__(self) -> None:
        self.before = torch.get_num_threads()
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.threads)

    def __exit__(self, *exc_info) -> None:
        if self.threads is not None and self.threads != self.before:
            torch.set_num_threads(self.before)
