"""Cached and uncached generation: same outputs, exactly the counted costs of the closed forms."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import reference as ref
from kvcache.reference import formulas
from kvcache.reference.randoms import random_matrix, random_problem


def count(fn, *args, **kwargs):
    ref.reset_muls()
    result = fn(*args, **kwargs)
    return result, ref.muls()


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 12), st.integers(0, 2**32 - 1))
def test_cached_equals_nocache_and_counts_match_closed_forms(d, length, seed):
    xs, Wq, Wk, Wv = random_problem(d, length, seed)
    nocache, n_count = count(ref.generate_nocache, xs, Wq, Wk, Wv)
    cached, c_count = count(ref.generate_cached, xs, Wq, Wk, Wv)
    assert ref.allclose(cached, nocache)
    assert n_count == formulas.single_head_nocache_total(length, d)
    assert c_count == formulas.single_head_cached_total(length, d)
    assert n_count == sum(3 * t * d * d + 2 * t * d for t in range(1, length + 1))
    assert c_count == sum(3 * d * d + 2 * t * d for t in range(1, length + 1))


def test_rectangular_heads_count_d_out_d_in_and_dk_dv():
    rng = random.Random(3)
    d_in, d_out, steps = 5, 3, 6
    Wq, Wk, Wv = (random_matrix(rng, d_out, d_in) for _ in range(3))
    xs = [[rng.gauss(0, 1) for _ in range(d_in)] for _ in range(steps)]
    _, n_count = count(ref.generate_nocache, xs, Wq, Wk, Wv)
    _, c_count = count(ref.generate_cached, xs, Wq, Wk, Wv)
    assert n_count == sum(3 * t * d_out * d_in + 2 * t * d_out for t in range(1, steps + 1))
    assert c_count == sum(3 * d_out * d_in + 2 * t * d_out for t in range(1, steps + 1))


@pytest.mark.parametrize("split", [0, 1, 5, 9, 10])
def test_two_calls_with_one_cache_equal_one_call(split):
    xs, Wq, Wk, Wv = random_problem(4, 10, seed=7)
    whole, whole_count = count(ref.generate_cached, xs, Wq, Wk, Wv)
    cache = ref.KVCache()
    ref.reset_muls()
    first = ref.generate_cached(xs[:split], Wq, Wk, Wv, cache=cache)
    second = ref.generate_cached(xs[split:], Wq, Wk, Wv, cache=cache)
    assert first + second == whole
    assert ref.muls() == whole_count
    assert len(cache) == 10


def test_store_is_applied_to_every_cached_element_and_changes_the_answer():
    xs, Wq, Wk, Wv = random_problem(4, 8, seed=1)
    seen = []

    def store(a):
        seen.append(a)
        return round(a, 2)

    exact = ref.generate_nocache(xs, Wq, Wk, Wv)
    cache = ref.KVCache()
    rounded = ref.generate_cached(xs, Wq, Wk, Wv, cache=cache, store=store)
    assert len(seen) == 8 * (4 + 4)  # every element of k and v, every step
    assert all(round(a, 2) == a for row in cache.keys + cache.values for a in row)
    assert not ref.allclose(rounded, exact)
    assert ref.max_abs_diff(rounded, exact) < 0.1
    assert ref.allclose(ref.generate_cached(xs, Wq, Wk, Wv, store=lambda a: a), exact)


def test_mul_table_rows_are_counted_and_equal_closed_forms():
    d = 5
    rows = ref.mul_table([1, 3, 8, 3], d, seed=2)
    assert [r["length"] for r in rows] == [1, 3, 8]
    for r in rows:
        n = r["length"]
        assert r["nocache_total"] == formulas.single_head_nocache_total(n, d)
        assert r["cached_total"] == formulas.single_head_cached_total(n, d)
        assert r["nocache_per_token"] == formulas.single_head_nocache_step(n, d)
        assert r["cached_per_token"] == formulas.single_head_cached_step(n, d)
        assert r["cached_projection_per_token"] == 3 * d * d
        assert r["nocache_projection_per_token"] == 3 * n * d * d
        assert r["cached_attention_per_token"] == r["nocache_attention_per_token"] == 2 * n * d
        assert r["total_ratio"] == r["nocache_total"] / r["cached_total"]


def test_mul_table_rejects_bad_lengths():
    with pytest.raises(ValueError, match="positive"):
        ref.mul_table([0, 4], 4)
    with pytest.raises(ValueError, match="positive"):
        ref.mul_table([], 4)
