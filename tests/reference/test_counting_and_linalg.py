"""The counter and the primitives: values, exact counts (off by one fails), errors."""

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import reference as ref


def counted(fn, *args, **kwargs):
    ref.reset_muls()
    result = fn(*args, **kwargs)
    return result, ref.muls()


def test_mul_returns_product_and_counts_each_call():
    ref.reset_muls()
    assert ref.mul(3.0, -2.5) == -7.5
    assert ref.mul(0.5, 4) == 2.0
    assert ref.muls() == 2
    ref.reset_muls()
    assert ref.muls() == 0


def test_counted_block_measures_only_its_own_multiplications():
    ref.reset_muls()
    ref.mul(1.0, 1.0)
    with ref.counted() as outer:
        ref.mul(1.0, 2.0)
        with ref.counted() as inner:
            ref.dot([1.0, 2.0, 3.0], [4.0, 5.0, 6.0])
    assert (inner.muls, outer.muls, ref.muls()) == (3, 4, 5)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 12), st.integers(0, 2**32 - 1))
def test_dot_value_and_count(length, seed):
    rng = random.Random(seed)
    x = [rng.uniform(-2, 2) for _ in range(length)]
    y = [rng.uniform(-2, 2) for _ in range(length)]
    value, count = counted(ref.dot, x, y)
    assert count == length
    assert value == pytest.approx(sum(a * b for a, b in zip(x, y)), abs=1e-12)


def test_dot_length_mismatch_names_both_lengths():
    with pytest.raises(ValueError, match=r"len\(x\)=2.*len\(y\)=3"):
        ref.dot([1.0, 2.0], [1.0, 2.0, 3.0])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 7), st.integers(1, 7), st.integers(0, 2**32 - 1))
def test_matvec_and_project_counts_for_rectangular_weights(d_out, d_in, seed):
    rng = random.Random(seed)
    W = [[rng.gauss(0, 1) for _ in range(d_in)] for _ in range(d_out)]
    x = [rng.gauss(0, 1) for _ in range(d_in)]
    value, count = counted(ref.matvec, W, x)
    assert count == d_out * d_in
    assert value == pytest.approx([sum(w * a for w, a in zip(row, x)) for row in W], abs=1e-12)
    (q, k, v), count = counted(ref.project, x, W, W, W)
    assert count == 3 * d_out * d_in
    assert q == k == v == value


def test_matvec_width_mismatch_is_a_value_error():
    with pytest.raises(ValueError, match="row 1 has width 3 but the vector has length 2"):
        ref.matvec([[1.0, 2.0], [1.0, 2.0, 3.0]], [1.0, 1.0])


def naive_attention(q, K, V):
    scores = [sum(a * b for a, b in zip(q, k)) / math.sqrt(len(q)) for k in K]
    top = max(scores)
    weights = [math.exp(s - top) for s in scores]
    total = sum(weights)
    return [sum(w / total * v[i] for w, v in zip(weights, V)) for i in range(len(V[0]))]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 6), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_attend_matches_naive_formula_with_exact_count(n, d_k, d_v, seed):
    rng = random.Random(seed)
    q = [rng.gauss(0, 1) for _ in range(d_k)]
    K = [[rng.gauss(0, 1) for _ in range(d_k)] for _ in range(n)]
    V = [[rng.gauss(0, 1) for _ in range(d_v)] for _ in range(n)]
    out, count = counted(ref.attend, q, K, V)
    assert count == n * d_k + n * d_v
    assert ref.allclose(out, naive_attention(q, K, V), rtol=1e-12, atol=1e-12)


def test_attend_softmax_is_stable_for_huge_scores():
    out = ref.attend([1000.0], [[1000.0], [999.0]], [[1.0], [0.0]])
    assert all(math.isfinite(x) for x in out)
    assert out[0] == pytest.approx(1 / (1 + math.exp(-1000 * 1 / 1)), abs=1e-12)


def test_attend_refuses_empty_or_mismatched_keys_and_values():
    with pytest.raises(ValueError, match="no keys/values"):
        ref.attend([1.0], [], [])
    with pytest.raises(ValueError, match="2 keys but 1 values"):
        ref.attend([1.0], [[1.0], [2.0]], [[1.0]])


def test_max_abs_diff_and_allclose_treat_shape_mismatch_as_difference():
    assert ref.max_abs_diff([[1.0, 2.0]], [[1.0, 2.5]]) == 0.5
    assert ref.max_abs_diff([1.0, 2.0], [1.0]) == math.inf
    assert ref.max_abs_diff([[1.0]], [1.0]) == math.inf
    assert not ref.allclose([1.0, 2.0], [1.0])
    assert not ref.allclose([[1.0]], [1.0])
    assert ref.allclose([1.0, 2.0], [1.0, 2.0 + 1e-13])
    assert not ref.allclose([1.0], [1.0 + 1e-6])
    assert ref.allclose([1.0], [1.1], rtol=0.1)
    assert not ref.allclose([math.nan], [math.nan])
