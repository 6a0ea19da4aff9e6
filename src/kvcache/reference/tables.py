"""The counted multiplication table: with and without the cache, per token and in total.

Every figure in a row is *counted* by running the single-head generation on seeded random
inputs; nothing is computed from the closed forms (those are in `formulas`, for checking).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.reference.counting import counted
from kvcache.reference.randoms import random_problem
from kvcache.reference.single_head import KVCache, step_cached, step_nocache


def mul_table(lengths: Iterable[int], d: int, seed: int = 0) -> list[dict[str, int | float]]:
    """One row per context length n (sorted, distinct, each ≥ 1) for a d×d single head.

    Keys of a row: `length`; `nocache_total`, `cached_total` (all multiplications to generate
    n tokens) and `total_ratio`; `nocache_per_token`, `cached_per_token` (the multiplications of
    step n alone) and `per_token_ratio`; and the split of step n into `*_projection_per_token`
    and `*_attention_per_token` (projections are what the cache makes constant; attention
    still grows with n).
    """
    wanted = sorted(set(int(n) for n in lengths))
    if not wanted or wanted[0] < 1:
        raise ValueError(f"mul_table: lengths must be positive integers, got {wanted}")
    if d < 1:
        raise ValueError(f"mul_table: d must be at least 1, got {d}")
    xs, Wq, Wk, Wv = random_problem(d, wanted[-1], seed)

    rows: dict[int, dict[str, int | float]] = {n: {"length": n} for n in wanted}
    for path in ("nocache", "cached"):
        cache = KVCache()
        total = 0
        for t in range(1, wanted[-1] + 1):
            tally: dict[str, int] = {}
            with counted() as step:
                if path == "nocache":
                    step_nocache(xs[:t], Wq, Wk, Wv, tally=tally)
                else:
                    step_cached(xs[t - 1], cache, Wq, Wk, Wv, tally=tally)
            total += step.muls
            if t in rows:
                row = rows[t]
                row[f"{path}_total"] = total
                row[f"{path}_per_token"] = step.muls
                row[f"{path}_projection_per_token"] = tally["projection"]
                row[f"{path}_attention_per_token"] = tally["attention"]
    for row in rows.values():
        row["total_ratio"] = row["nocache_total"] / row["cached_total"]
        row["per_token_ratio"] = row["nocache_per_token"] / row["cached_per_token"]
    return [rows[n] for n in wanted]
