"""The matrix unit's products (AMX tiles, `numba_amx`) of many activation rows with ggml blocks:
the one-row kernels' products (which `test_block_step` pins to llama.cpp's rules) to the bit, in
every format and at shapes that are no multiple of a tile; each row's outputs the same to the bit
whatever rows stand beside it; a NaN reaching the outputs; and the block step running a prompt's
chunk on them."""

from __future__ import annotations

import numpy as np
import pytest
from gguf_files import quantize_blocks

from kvcache.backends.cpu import numba_products
from kvcache.model.quantized import STORED_KINDS

pytestmark = [pytest.mark.kernels,
              pytest.mark.skipif(not numba_products.available(), reason="numba with OpenMP/TBB threads")]
KINDS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(scope="module")
def unit():
    found = numba_products.matrix_unit()
    if found is None:
        pytest.skip("this CPU has no AMX tiles (or the kernel refused them): products stay on the kernels")
    return found


def _part(rng, kind: str, rows: int, columns: int) -> tuple[np.ndarray, int]:
    blocks = quantize_blocks(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    return numba_products.block_part_of(blocks, kind, q8=True)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(3))
def test_tiles_give_the_one_row_dots_products_to_the_bit(unit, kind, seed):
    """The tiles' sums equal the kernels' (each activation row alone, and four at a time on the
    4x4 tiles) to the bit."""
    rng = np.random.default_rng(seed)
    columns = STORED_KINDS[kind][0] * int(rng.integers(1, 5))
    parts = tuple(_part(rng, kind, int(rows), columns) for rows in rng.integers(1, 40, 2))
    tokens = int(rng.integers(17, 50))
    x = (rng.standard_normal((tokens, columns)) * rng.gamma(1.0, 1.0, columns)).astype(np.float32)
    x[0, :32] = 0.0  # (a block of zeros: its Q8 scale 0)
    bias = rng.standard_normal(numba_products.outputs(parts)).astype(np.float32)
    expected = numba_products.product(x, parts, bias)
    alone = np.concatenate([numba_products.product(x[n : n + 1], parts, bias) for n in range(tokens)])
    got = numba_products.tiles_product(x, parts, bias)
    assert got.shape == expected.shape
    assert np.array_equal(got, alone) and np.array_equal(expected, alone)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q4_K", "Q6_K"])
def test_a_rows_tile_products_do_not_depend_on_the_rows_beside_it(unit, kind):
    """The same 17 rows alone, then among 40 others in another order: each row's outputs equal to
    the bit (a prompt's chunking does not change a token's products on the tiles)."""
    rng = np.random.default_rng(7)
    columns = STORED_KINDS[kind][0] * 2
    parts = (_part(rng, kind, 35, columns),)
    x = rng.standard_normal((57, columns)).astype(np.float32)
    alone = numba_products.tiles_product(x[:17], parts)
    order = rng.permutation(57)
    among = numba_products.tiles_product(x[order], parts)[np.argsort(order)][:17]
    assert np.array_equal(alone, among)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_nan_in_an_activation_reaches_that_rows_outputs_only(unit, kind):
    rng = np.random.default_rng(3)
    columns = STORED_KINDS[kind][0]
    parts = (_part(rng, kind, 20, columns),)
    x = rng.standard_normal((18, columns)).astype(np.float32)
    x[5, 3] = np.nan
    got = numba_products.tiles_product(x, parts)
    assert np.isnan(got[5]).all() and np.isfinite(np.delete(got, 5, axis=0)).all()
