"""numba's one-row products against float64 products of the same values on many random shapes
(sizes that split unevenly between threads, a single row or column, a long row), float32 at 1
and 2 threads and bfloat16 read in place as pairs; its rounding to bfloat16 is torch's (ties,
NaN, infinities, subnormals); stored keys become rows without a copy where they can; and numba is
available here with an OpenMP or TBB pool, so the steps' tests run its kernels
(tests/backends/test_numpy_step.py and test_half_step.py run both roads, test_numba_step.py
long caches)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.backends import numba_products


def test_numba_runs_on_a_fast_pool_here():
    assert numba_products.available()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 300), columns=st.integers(1, 300), seed=st.integers(0, 2**16),
       threads=st.integers(1, 2))
def test_the_product_is_numpys_to_float32_rounding(rows, columns, seed, threads):
    generator = np.random.default_rng(seed)
    weight = generator.standard_normal((rows, columns), dtype=np.float32)
    x = generator.standard_normal(columns, dtype=np.float32)
    before = numba.get_num_threads()
    numba_products.set_threads(threads)
    try:
        out = numba_products.product(x, (weight,))
    finally:
        numba.set_num_threads(before)
    exact = weight.astype(np.float64) @ x.astype(np.float64)
    scale = np.abs(weight).astype(np.float64) @ np.abs(x).astype(np.float64)  # the sum's magnitude
    assert out.shape == (rows,) and out.dtype == np.float32
    assert np.all(np.abs(out - exact) <= 1e-6 * columns * scale + 1e-30)


@pytest.mark.parametrize("shape", [(1, 1), (1, 4096), (4099, 3), (576, 576)])
def test_edge_shapes(shape):
    generator = np.random.default_rng(1)
    weight = generator.standard_normal(shape, dtype=np.float32)
    x = generator.standard_normal(shape[1], dtype=np.float32)
    np.testing.assert_allclose(numba_products.product(x, (weight,)), weight @ x, rtol=1e-4, atol=1e-4)


def test_rounding_to_bfloat16_is_torchs():
    generator = np.random.default_rng(3)
    values = np.concatenate([
        generator.standard_normal(4000).astype(np.float32) * 10.0 ** generator.integers(-30, 30, 4000),
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-45, 1.00390625, 1.01171875],
                 np.float32),  # (the last two: ties, to even downwards and upwards)
    ]).astype(np.float32)
    ours = numba_products.rounded_to_bfloat16(values)
    theirs = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(1, 120), min_size=1, max_size=3), pairs=st.integers(1, 150),
       bias=st.booleans(), seed=st.integers(0, 2**16))
def test_the_bfloat16_product_is_the_float64_product_of_the_rounded_values_rounded(rows, pairs, bias, seed):
    """Parts stacked along out, x rounded to bfloat16, the float64 product (+ bias) rounded to
    bfloat16: within one bfloat16 rounding of float32 summation error."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, 2 * pairs, generator=generator).to(torch.bfloat16) for n in rows]
    x = torch.randn(2 * pairs, generator=generator).numpy()
    b = torch.randn(sum(rows), generator=generator).numpy() if bias else None
    out = numba_products.product(
        x, tuple(numba_products.bfloat16_pairs(w) for w in weights), b, bf16=True)
    stacked = torch.cat(weights).double().numpy()
    x_rounded = numba_products.rounded_to_bfloat16(x).astype(np.float64)
    exact = stacked @ x_rounded + (0.0 if b is None else b.astype(np.float64))
    summed = np.abs(stacked) @ np.abs(x_rounded) + (0.0 if b is None else np.abs(b))
    eps = float(torch.finfo(torch.bfloat16).eps)
    assert out.shape == (sum(rows),) and out.dtype == np.float32
    assert np.array_equal(out, numba_products.rounded_to_bfloat16(out))  # a bfloat16 value
    assert np.all(np.abs(out - exact) <= eps * np.abs(exact) + 1e-6 * 2 * pairs * summed + 1e-30)


def test_only_an_even_contiguous_weight_is_viewed_as_pairs():
    weight = torch.randn(4, 6).to(torch.bfloat16)
    pairs = numba_products.bfloat16_pairs(weight)
    assert pairs.shape == (4, 3) and pairs.dtype == np.uint32
    assert pairs.ctypes.data == weight.data_ptr()  # a view of the parameter's memory
    assert numba_products.bfloat16_pairs(torch.randn(4, 5).to(torch.bfloat16)) is None
    assert numba_products.bfloat16_pairs(weight.T) is None


@pytest.mark.parametrize("capacity", [7, 12])
def test_stored_keys_become_rows_without_a_copy_where_they_can(capacity):
    buffer = np.arange(2 * 3 * capacity * 4, dtype=np.float32).reshape(2 // 2, 6, capacity, 4)
    stored = buffer[:, :, :7]  # a cache buffer narrowed to 7 of its `capacity` tokens
    rows, step = numba_products.stored_rows(stored)
    assert rows.flags.c_contiguous and np.shares_memory(rows, buffer) and step == capacity
    for head in range(6):
        assert np.array_equal(rows[head * step:head * step + 7], stored[0, head])
    scattered = buffer[:, :, :7, ::2]  # rows not contiguous: a copy
    rows, step = numba_products.stored_rows(scattered)
    assert not np.shares_memory(rows, buffer) and step == 7
    assert np.array_equal(rows.reshape(6, 7, 2), scattered[0])
