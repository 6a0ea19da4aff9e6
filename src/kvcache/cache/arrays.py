"""numpy arrays of cached keys and values, for the kernels that read and write a cache's storage
in place (`PagedLayer.storage_rows`). numpy has no bfloat16, so a bfloat16 tensor passes as its bits: a uint16
array of the same shape sharing its memory (a bfloat16 is a float32's upper 16 bits)."""

from __future__ import annotations

import numpy as np
import torch


def tensor_of(array: np.ndarray) -> torch.Tensor:
    """The tensor sharing `array`'s memory: uint16 (bfloat16 bits) as bfloat16, any other dtype
    as torch.from_numpy gives it."""
    tensor = torch.from_numpy(array)
    return tensor.view(torch.bfloat16) if array.dtype == np.uint16 else tensor


def array_of(tensor: torch.Tensor) -> np.ndarray:
    """The numpy array sharing a CPU tensor's memory: bfloat16 as its bits (uint16), any other
    dtype as tensor.numpy() gives it (raising for a tensor that needs grad or has no numpy dtype)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16)
    return tensor.numpy()
