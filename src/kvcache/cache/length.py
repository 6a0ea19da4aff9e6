"""The length of a compiled fixed-capacity layer, kept so that compiled code never reads a
Python int.

Updates advance a 0-d tensor, so a compiled graph does not specialise on the length and one
compiled decode step serves every position; they mark the int stale, and the next eager read
refreshes it from the tensor (one read back). Eager code may also set it (crop, reset).
"""

from __future__ import annotations

import torch

from .layer import normal_tensors


class LengthTracker:
    """Tokens seen by one layer: a 0-d long tensor that updates advance, and a Python int for
    eager reads."""

    def __init__(self) -> None:
        self._value = 0
        self._stale = False
        self.tensor: torch.Tensor | None = None  # () long, on the layer's device

    def bind(self, device: torch.device) -> None:
        """Create the tensor copy on `device` (called when the layer allocates its storage)."""
        with normal_tensors():
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

    def advance(self, new_tokens: int) -> None:
        """Advance the tensor (compiled code may call this); the int is refreshed on the next
        `get`."""
        assert self.tensor is not None
        self.tensor.add_(new_tokens)
        self._stale = True


class LengthInTensor:
    """What a compiled fixed-capacity layer puts before its eager class (`class
    CompiledStaticLayer(LengthInTensor, StaticLayer)`): the eager class's `_length` becomes a
    `LengthTracker`, bound to the buffer's device when the buffer is allocated, and the next
    token's position is the length tensor."""

    def __init__(self, *args, **kwargs) -> None:
        self._tracker = LengthTracker()  # before the buffer is allocated (it binds the tensor)
        super().__init__(*args, **kwargs)

    @property
    def _length(self) -> int:
        """Tokens seen, as a Python int (eager reads only: may read the tensor back once)."""
        return self._tracker.get()

    @_length.setter
    def _length(self, length: int) -> None:
        self._tracker.set(length)

    def _allocate(self, key_shape, value_shape, dtype, device) -> None:
        super()._allocate(key_shape, value_shape, dtype, device)  # type: ignore[misc]
        self._tracker.bind(device)

    def start_position(self) -> int | torch.Tensor:
        """The length tensor (0 before the buffer exists)."""
        return 0 if self._tracker.tensor is None else self._tracker.tensor
