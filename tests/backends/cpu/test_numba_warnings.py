"""An install's first run compiles the kernels; numba's own internal warnings from that compile
(an IR check its inliner trips, "Please report the warning") never reach the user."""

from __future__ import annotations

import warnings

import numba
import numpy as np
import pytest
from numba.core.errors import NumbaWarning

from kvcache.backends.cpu import numba_products

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not numba_products.available(), reason="numba with OpenMP/TBB threads")]


@pytest.mark.parametrize("row_dtype", [np.uint8, np.int8], ids=["int8 rows", "fp8 rows"])
def test_compiling_a_kernel_shows_none_of_numbas_warnings(row_dtype):
    """`store` writes keys and values into packed rows through an inlined overload used twice,
    which trips numba's check; compiled afresh (not read from numba's disk cache) with every
    warning recorded, none of numba's is."""
    kernels = numba_products.kernels()
    options = {key: value for key, value in kernels.store.targetoptions.items() if key != "nopython"}
    fresh = numba.njit(**{**options, "cache": False})(kernels.store.py_func)
    heads, kv_heads, dim = 4, 2, 16
    qkv = np.linspace(-1.0, 1.0, 2 * (heads + 2 * kv_heads) * dim, dtype=np.float32).reshape(2, -1)
    keys, values = (np.zeros((8, dim + 4), row_dtype) for _ in range(2))  # (codes, then two float16s)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh(qkv, heads, kv_heads, np.array([0, 1]), keys, values)
    assert keys.any() and values.any()
    assert [str(w.message) for w in caught if issubclass(w.category, NumbaWarning)] == []
