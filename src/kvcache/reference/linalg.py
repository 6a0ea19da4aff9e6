"""Dot products, matrix-vector products and one attention query, by hand on lists of floats.

A vector is a list of floats; a matrix is a list of rows (d_out rows of length d_in). Every
multiplication goes through `counting.mul`; the count each function costs is in its docstring.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvcache.reference.counting import mul

Vector = Sequence[float]
Matrix = Sequence[Sequence[float]]


def dot(x: Vector, y: Vector) -> float:
    """x · y. Costs `len(x)` multiplications. Different lengths -> ValueError naming both."""
    if len(x) != len(y):
        raise ValueError(f"dot: vectors differ in length: len(x)={len(x)}, len(y)={len(y)}")
    total = 0.0
    for a, b in zip(x, y):
        total += mul(a, b)
    return total


def matvec(W: Matrix, x: Vector) -> list[float]:
    """W x for W of d_out rows of length d_in and x of length d_in -> list of d_out floats.

    Costs `len(W) * len(x)` multiplications. A row whose width is not len(x) -> ValueError.
    """
    out = []
    for row_index, row in enumerate(W):
        if len(row) != len(x):
            raise ValueError(
                f"matvec: matrix row {row_index} has width {len(row)} but the vector has "
                f"length {len(x)}"
            )
        out.append(dot(row, x))
    return out


def project(x: Vector, Wq: Matrix, Wk: Matrix, Wv: Matrix) -> tuple[list[float], ...]:
    """(q, k, v) = (Wq x, Wk x, Wv x). Costs 3·d_out·d_in multiplications (3d² for d×d)."""
    return matvec(Wq, x), matvec(Wk, x), matvec(Wv, x)


def softmax(scores: Sequence[float]) -> list[float]:
    """Numerically stable softmax: subtract the max, exp, divide by the sum. No multiplications."""
    top = max(scores)
    exps = [math.exp(s - top) for s in scores]
    total = sum(exps)
    return [e / total for e in exps]


def attend(q: Vector, K: Matrix, V: Matrix) -> list[float]:
    """One query over n stored keys K (n × d_k) and values V (n × d_v) -> output of length d_v.

    scores_j = (q · K_j) / sqrt(d_k) (the scale is a division, not counted), w = softmax(scores),
    out_i = Σ_j w_j · V_j[i]. Costs exactly n·d_k + n·d_v multiplications.
    Empty K/V, or K and V of different lengths -> ValueError.
    """
    if len(K) == 0 or len(V) == 0:
        raise ValueError(f"attend: no keys/values to attend over (len(K)={len(K)}, len(V)={len(V)})")
    if len(K) != len(V):
        raise ValueError(f"attend: {len(K)} keys but {len(V)} values; they must match")
    scale = math.sqrt(len(q))
    weights = softmax([dot(q, key) / scale for key in K])
    d_v = len(V[0])
    out = [0.0] * d_v
    for w, value in zip(weights, V):
        if len(value) != d_v:
            raise ValueError(f"attend: value rows differ in width ({len(value)} vs {d_v})")
        for i in range(d_v):
            out[i] += mul(w, value[i])
    return out
