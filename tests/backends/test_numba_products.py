"""numba's one-row product against numpy's float64 product on many random shapes (sizes that
split unevenly between threads, a single row or column, a long row), at every thread count
from 1 to the machine's; and numba is available here with an OpenMP or TBB pool, so the numpy
step's tests run its numba products (tests/backends/test_numpy_step.py runs both sides)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
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
        out = numba_products.matvec(x, weight)
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
    np.testing.assert_allclose(numba_products.matvec(x, weight), weight @ x, rtol=1e-4, atol=1e-4)
