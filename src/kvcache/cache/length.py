"""The length of a fixed-capacity layer, kept so that compiled code never reads a Python int.

Eager code reads and sets a Python int (no device sync). Compiled code (torch.compile) reads
and advances a 0-d tensor instead, so the graph does not specialise on the length and one
compiled decode step serves every position; it marks the int stale, and the next eager read
refreshes it from the tensor.
"""

from __future__ import annotations

import torch


class LengthTracker:
    """Tokens seen by one layer: a Python int for eager code, a 0-d long tensor for compiled."""

    def __init__(self) -> None:
        self._value = 0
        self._stale = False
        self.tensor: torch.Tensor | None = None  # () long, on the layer's device

    def bind(self, device: torch.device) -> None:
        """Create the tensor copy on `device` (called when the layer allocates its storage)."""
        self.tensor = torch.full((), self.get(), dtype=torch.long, device=device)  # ()

    def get(self) -> int:
        """The length as a Python int (eager code only; may sync once after compiled steps)."""
        if self._stale and self.tensor is not None:
            self._value = int(self.tensor)
            self._stale = False
        return self._value

    def set(self, length: int) -> None:
        """Set the length from eager code."""
        self._value = length
        self._stale = False
        if self.tensor is not None:
            self.tensor.fill_(length)

    def advance_compiled(self, new_tokens: int) -> None:
        """Advance the tensor from compiled code; the int is refreshed on the next `get`."""
        assert self.tensor is not None
        self.tensor.add_(new_tokens)
        self._stale = True
