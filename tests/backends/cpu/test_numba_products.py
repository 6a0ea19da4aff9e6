"""numba's one-row products against float64 products of the same values on many random shapes
(sizes that split unevenly between threads, a single row or column, a long row), float32 at 1
and 2 threads, bfloat16 and float16 read in place as their bits; its rounding to bfloat16 is
torch's (ties, NaN, infinities, subnormals); stored keys become rows without a copy where they
can; and numba is
available here with an OpenMP or TBB pool, so the steps' tests run its kernels
(tests/backends/test_float32_step.py and test_half_step.py run both roads, test_numba_step.py
long caches)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcache.backends.cpu import numba_products

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


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
    ours = (numba_products.bfloat16_bits_of(values).astype(np.uint32) << 16).view(np.float32)
    theirs = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.integers(1, 120), min_size=1, max_size=3), columns=st.integers(1, 300),
       bias=st.booleans(), seed=st.integers(0, 2**16))
@example(rows=[108], columns=1, bias=False, seed=2970)  # a float16 product below its smallest normal
def test_the_half_product_is_the_float64_product_of_the_rounded_values_rounded(
    dtype, rows, columns, bias, seed
):
    """Parts stacked along out, read as their bits; x rounded to the weights' dtype, the float64
    product (+ bias) rounded to it: a value of that dtype, within one rounding of float32
    summation error."""
    generator = torch.Generator().manual_seed(seed)
    weights = [torch.randn(n, columns, generator=generator).to(dtype) for n in rows]
    x = torch.randn(columns, generator=generator)
    b = torch.randn(sum(rows), generator=generator).numpy() if bias else None
    out = numba_products.product(x.numpy(), tuple(numba_products.half_bits(w) for w in weights), b, dtype)
    stacked = torch.cat(weights).double().numpy()
    x_rounded = x.to(dtype).double().numpy()
    exact = stacked @ x_rounded + (0.0 if b is None else b.astype(np.float64))
    summed = np.abs(stacked) @ np.abs(x_rounded) + (0.0 if b is None else np.abs(b))
    eps = float(torch.finfo(dtype).eps)
    # one rounding to dtype: relative to the value, or below its smallest normal one subnormal step
    subnormal_step = float(torch.finfo(dtype).smallest_normal) * eps
    assert out.shape == (sum(rows),) and out.dtype == np.float32
    assert np.array_equal(out, torch.from_numpy(out).to(dtype).float().numpy())  # a value of dtype
    assert np.all(np.abs(out - exact) <= eps * np.abs(exact) + subnormal_step + 1e-6 * columns * summed)


def test_a_contiguous_half_precision_weight_is_viewed_as_its_bits():
    for dtype, bits_dtype in ((torch.bfloat16, np.uint16), (torch.float16, np.int16)):
        weight = torch.randn(4, 5).to(dtype)
        bits = numba_products.half_bits(weight)
        assert bits.shape == (4, 5) and bits.dtype == bits_dtype
        assert bits.ctypes.data == weight.data_ptr()  # a view of the parameter's memory
        assert numba_products.half_bits(weight.T) is None


def test_compiling_reports_each_kvcache_kernel_once_and_not_what_it_compiles_inside():
    source = (
        "def inner(x):\n    return x + 1\n"
        "def outer(x):\n    return inner(x) * 2\n"
    )
    space = {"__name__": "kvcache.made_for_a_test"}  # a kernel of kvcache's, as numba sees it
    exec(source, space)
    space["inner"] = numba.njit(space["inner"])
    outer = numba.njit(space["outer"])
    other = numba.njit(lambda x: x - 1)  # not kvcache's: not reported
    reported = []
    with numba_products.compiling_reported(reported.append):
        assert outer(3) == 8 and other(3) == 2
        assert outer(4) == 10  # compiled already: nothing new
    assert reported == ["outer"]
    outer(5.5)  # a new signature outside: not reported
    assert reported == ["outer"]


def test_attentions_exp_is_within_an_ulp_and_zero_where_a_key_is_masked():
    """`exp_below` (the attention's softmax weights, vectorized arithmetic instead of a libm call
    a value): e^x within about one float32 ulp over the scores less their top, exactly 1 at the
    top, 0 for a masked key (-inf) and below float32's normal range."""
    kernels = numba_products.kernels()
    scores = np.abs(np.random.default_rng(0).standard_normal(5000)) * 30
    x = -np.concatenate([np.linspace(0, 87, 20001), scores[scores <= 87]]).astype(np.float32)
    got = np.array([kernels.exp_below(value) for value in x], np.float64)
    exact = np.exp(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 1.5e-7
    assert kernels.exp_below(np.float32(0.0)) == 1.0
    assert [kernels.exp_below(np.float32(v)) for v in (-np.inf, -87.5, -1000.0)] == [0.0, 0.0, 0.0]


def test_the_kernels_swiglu_is_silu_times_up_within_float32_rounding():
    """`swiglu_rows` (a long step's activation, outside the layer calls) against float64, inf and
    nan gates included: silu(+inf)·up is inf·up, silu(-inf) nan (inf/inf, as torch's), nan stays."""
    rng = np.random.default_rng(4)
    gate_up = (rng.standard_normal((33, 2 * 70)) * 12).astype(np.float32)
    gate_up[0, :3] = [np.inf, -np.inf, np.nan]
    out = np.empty((33, 70), np.float32)
    numba_products.kernels().swiglu_rows(gate_up, out)
    gate, up = gate_up[:, :70].astype(np.float64), gate_up[:, 70:].astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = gate / (1.0 + np.exp(-gate)) * up
    finite = np.isfinite(expected)
    assert np.allclose(out[finite], expected[finite], rtol=1e-6, atol=1e-30)
    assert np.isinf(out[0, 0]) and np.isnan(out[0, 1]) and np.isnan(out[0, 2])
