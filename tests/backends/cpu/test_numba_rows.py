"""The kernels' fp8 rows (`numba_rows`): stored with the rounding torch's float8_e4m3fn cast gives
(to nearest, ties to even, subnormals included), read back as the e4m3 values `formats` unpacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcache.backends.cpu import numba_products
from kvcache.cache.paged.formats import PackedRows

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

DIM = 64


def _e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value (ascending) and each midpoint between neighbours (the ties)."""
    values = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].unique()  # (253,) sorted, one zero
    return torch.cat((values, (values[1:] + values[:-1]) / 2))


def test_fp8_rows_are_stored_as_torch_rounds_and_read_back_as_formats_unpacks():
    assert numba_products.available()
    grid = _e4m3_grid()
    extra = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-4, 2.6, 2000)
    extra = extra.clamp(-440, 440)  # (within e4m3's range: every row's scale is exactly 1)
    values = torch.cat((grid, extra))
    per_row = DIM - 1
    rows = -(-len(values) // per_row)
    x = torch.zeros(rows * per_row)
    x[: len(values)] = values
    x = torch.cat((torch.full((rows, 1), 448.0), x.view(rows, per_row)), dim=1)  # scale exactly 1
    qkv = np.ascontiguousarray(torch.cat((x, x, x), dim=1).numpy())  # (rows, 3·D): q, k, v of one head
    # (values as bfloat16 bits: the pair of row types the other kernel tests compile)
    keys, values_out = np.zeros((rows, DIM + 4), np.int8), np.zeros((rows, DIM), np.uint16)
    numba_products.kernels().store(qkv, 1, 1, np.arange(rows, dtype=np.int64), keys, values_out)
    packing = PackedRows("fp8", DIM)
    expected = packing.pack(x)  # torch's arithmetic (`kvcache.cache.quantize`)
    assert torch.equal(torch.from_numpy(keys), expected)
    assert packing.valid(torch.from_numpy(keys))
    read = packing.unpack(torch.from_numpy(keys), torch.float32)
    torch.testing.assert_close(read, x.to(torch.float8_e4m3fn).float(), atol=0, rtol=0)


@pytest.mark.parametrize("name", ["int8", "int4", "fp8"])
def test_packed_rows_the_kernels_store_are_the_bytes_formats_packs(name):
    """Rows of every spread (scales far from 1, constant rows, a row of zeros, bfloat16 values
    that tie): the kernels' codes, scales and zeros are torch's, bit for bit (the divisions are
    IEEE's, not the kernels' fast-math reciprocals)."""
    assert numba_products.available()
    generator = torch.Generator().manual_seed(3)
    spread = torch.logspace(-3, 3, 400).unsqueeze(1)
    x = (torch.randn(400, DIM, generator=generator) * spread).to(torch.bfloat16).float()
    x[0], x[1] = 0.0, 2.5  # a row of zeros, a constant row
    packing = PackedRows(name, DIM)
    qkv = np.ascontiguousarray(torch.cat((x, x, x), dim=1).numpy())
    rows = [np.zeros((len(x), packing.width), np.int8 if name == "fp8" else np.uint8) for _ in "kv"]
    if name == "fp8":  # (values as bfloat16 bits: the pair of row types the other tests compile)
        rows[1] = np.zeros((len(x), DIM), np.uint16)
    numba_products.kernels().store(qkv, 1, 1, np.arange(len(x), dtype=np.int64), *rows)
    assert torch.equal(torch.from_numpy(rows[0]), packing.pack(x))


def test_a_nan_stays_a_nan_code_in_an_fp8_row():
    x = torch.randn(2, DIM, generator=torch.Generator().manual_seed(4))
    x[1, 5] = float("nan")
    qkv = np.ascontiguousarray(torch.cat((x, x, x), dim=1).numpy())
    rows = [np.zeros((2, DIM + 4), np.int8), np.zeros((2, DIM), np.uint16)]
    numba_products.kernels().store(qkv, 1, 1, np.arange(2, dtype=np.int64), *rows)
    packing = PackedRows("fp8", DIM)
    assert packing.valid(torch.from_numpy(rows[0][:1])) and not packing.valid(torch.from_numpy(rows[0]))
