"""Seeded random inputs and weights for the lab (lists of floats, `random.Random`, no numpy)."""

from __future__ import annotations

import math
import random


def random_vector(rng: random.Random, length: int, scale: float = 1.0) -> list[float]:
    """`length` floats drawn from N(0, scale²)."""
    return [rng.gauss(0.0, scale) for _ in range(length)]


def random_matrix(rng: random.Random, rows: int, cols: int) -> list[list[float]]:
    """rows × cols floats from N(0, 1/cols): a projection that keeps activations near unit size."""
    scale = 1.0 / math.sqrt(cols)
    return [random_vector(rng, cols, scale) for _ in range(rows)]


def random_problem(d: int, length: int, seed: int = 0):
    """(xs, Wq, Wk, Wv): `length` input vectors of size d and three d×d weight matrices."""
    rng = random.Random(seed)
    Wq, Wk, Wv = (random_matrix(rng, d, d) for _ in range(3))
    xs = [random_vector(rng, d) for _ in range(length)]
    return xs, Wq, Wk, Wv
