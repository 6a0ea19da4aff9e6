"""One attention head generating step by step, without and with a KV cache.

Without a cache, step t projects q, k and v of *every* position 1..t anew (as a model without a
cache recomputes its context), then the last query attends over all t keys/values:
    count(step t) = 3·t·d_out·d_in + t·d_k + t·d_v          (3·t·d² + 2·t·d for d×d weights)
With a cache, step t projects only x_t and appends k_t, v_t:
    count(step t) = 3·d_out·d_in + t·d_k + t·d_v            (3·d² + 2·t·d)
Projections become constant per token; attention still grows with t.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.reference.counting import muls
from kvcache.reference.linalg import Matrix, Vector, attend, project


class KVCache:
    """The keys and values appended so far, one row per position: `len(cache)` positions."""

    def __init__(self) -> None:
        self.keys: list[list[float]] = []
        self.values: list[list[float]] = []

    def append(self, k: Vector, v: Vector) -> None:
        """Store the key and value of one more position."""
        self.keys.append(list(k))
        self.values.append(list(v))

    def __len__(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:
        return f"KVCache(positions={len(self)})"


def _tally(tally: dict[str, int] | None, phase: str, before: int) -> None:
    if tally is not None:
        tally[phase] = tally.get(phase, 0) + muls() - before


def step_nocache(
    prefix: Sequence[Vector], Wq: Matrix, Wk: Matrix, Wv: Matrix,
    tally: dict[str, int] | None = None,
) -> list[float]:
    """Output for the last position of `prefix` (t vectors), recomputing q, k, v of all t.

    Costs 3·t·d_out·d_in (projection) + t·(d_k + d_v) (attention). If `tally` is given, the
    counted multiplications are added to it under "projection" and "attention".
    """
    before = muls()
    projected = [project(x, Wq, Wk, Wv) for x in prefix]
    _tally(tally, "projection", before)
    before = muls()
    q_last = projected[-1][0]
    y = attend(q_last, [k for _, k, _ in projected], [v for _, _, v in projected])
    _tally(tally, "attention", before)
    return y


def step_cached(
    x: Vector, cache: KVCache, Wq: Matrix, Wk: Matrix, Wv: Matrix,
    store: Callable[[float], float] | None = None,
    tally: dict[str, int] | None = None,
) -> list[float]:
    """Output for one new position x: project only x, append (k, v) to `cache`, attend over it.

    `store`, if given, is applied to every element of k and v before they are written (the
    low-precision experiment). Costs 3·d_out·d_in + len(cache)·(d_k + d_v) after the append.
    """
    before = muls()
    q, k, v = project(x, Wq, Wk, Wv)
    _tally(tally, "projection", before)
    if store is not None:
        k = [store(a) for a in k]
        v = [store(a) for a in v]
    cache.append(k, v)
    before = muls()
    y = attend(q, cache.keys, cache.values)
    _tally(tally, "attention", before)
    return y


def generate_nocache(xs: Sequence[Vector], Wq: Matrix, Wk: Matrix, Wv: Matrix) -> list[list[float]]:
    """Outputs y_1..y_T with y_t = attend(q_t, K_1..t, V_1..t), recomputing everything each step.

    Costs Σ_t (3·t·d² + 2·t·d) multiplications for d×d weights.
    """
    return [step_nocache(xs[: t + 1], Wq, Wk, Wv) for t in range(len(xs))]


def generate_cached(
    xs: Sequence[Vector], Wq: Matrix, Wk: Matrix, Wv: Matrix, *,
    cache: KVCache | None = None,
    store: Callable[[float], float] | None = None,
) -> list[list[float]]:
    """The same outputs as `generate_nocache`, projecting each x once and caching its k, v.

    `cache` continues an earlier call (the multi-turn case: two calls on the halves of xs with
    one cache equal one call on all of it). Costs Σ_t (3·d² + 2·t·d) for d×d weights, where t
    counts the positions in the cache after each append.
    """
    if cache is None:
        cache = KVCache()
    return [step_cached(x, cache, Wq, Wk, Wv, store=store) for x in xs]
