"""numpy operations on float32 rows that the array steps share (`cpu_backend`, `paged_step`)."""

from __future__ import annotations

import math

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (rows, n) / rms(x) * weight (n,), float32 (a new array)."""
    if x.shape[0] == 1:
        row = x[0]
        inverse_rms = 1.0 / math.sqrt(float(row @ row) / row.shape[0] + eps)  # a Python float
        out = x * weight
        out *= inverse_rms
        return out
    squares = np.add.reduce(x * x, axis=-1, keepdims=True)  # (rows, 1)
    squares *= 1.0 / x.shape[-1]
    squares += eps
    np.sqrt(squares, out=squares)
    out = x / squares
    out *= weight
    return out


def rotate(x: np.ndarray, cos: np.ndarray, signed_sin: np.ndarray) -> np.ndarray:
    """RoPE on numpy rows, the formula of the model's `apply_rope` and the kernels' `turned`:
    x_i·cos_i + x_{(i + D/2) mod D}·signed_sin_i, for x (..., D) and cos, signed_sin broadcast
    to it (each row's position, from `CpuBackend.rope_rows`); a new float32 array."""
    half = x.shape[-1] // 2
    swapped = np.concatenate((x[..., half:], x[..., :half]), axis=-1)  # halves exchanged
    swapped *= signed_sin
    out = x * cos
    out += swapped
    return out
