"""Comparing nested lists of floats: a shape mismatch is a difference, never an exception."""

from __future__ import annotations

import math
from typing import Any


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest |a_i - b_i| over nested lists of floats; `math.inf` if the shapes differ."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            return math.inf
        return max((max_abs_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return abs(float(a) - float(b))


def allclose(a: Any, b: Any, rtol: float = 1e-9, atol: float = 1e-12) -> bool:
    """True if a and b have the same nested shape and |a_i - b_i| <= atol + rtol·|b_i| everywhere."""
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        if not (isinstance(a, (list, tuple)) and isinstance(b, (list, tuple))) or len(a) != len(b):
            return False
        return all(allclose(x, y, rtol, atol) for x, y in zip(a, b))
    x, y = float(a), float(b)
    if math.isnan(x) or math.isnan(y):
        return False
    return abs(x - y) <= atol + rtol * abs(y)
