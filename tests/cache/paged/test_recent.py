"""The full-precision window of a paged pool in a kv_dtype (`PagedCache(kv_window=W)`, `recent`):
every read of a row's last W positions (those it wrote itself) returns the rows exactly as the
forward gave them, every other read returns them as stored, on random rows, chunks and windows,
against a naive reference that keeps every row it was given."""

from __future__ import annotations

import random

import pytest
import torch

from kvcache.cache import CacheConfigError, PagedCache
from kvcache.cache.paged.formats import row_format

HEADS, DIM, BLOCK = 2, 16, 4


def as_stored(kv_dtype: str, rows: torch.Tensor) -> torch.Tensor:
    """rows (…, D) through the kv_dtype's row format and back."""
    packing = row_format(kv_dtype, rows.shape[-1])
    return packing.unpack(packing.pack(rows), rows.dtype)


def expected_reads(kept: list[torch.Tensor], total: int, exact_from: int, kv_dtype: str) -> torch.Tensor:
    """(H_kv, total, D): the naive reference of one row's reads, its rows kept (T, H_kv, D)."""
    rows = torch.cat(kept)[:total]
    stored = as_stored(kv_dtype, rows)
    exact = torch.arange(total)[:, None, None] >= exact_from
    return torch.where(exact, rows, stored).transpose(0, 1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("kv_dtype", ["int4", "int8/fp8"])
def test_reads_are_exact_in_the_window_and_as_stored_before_it(seed, kv_dtype):
    rng = random.Random(seed)
    window = rng.choice([1, 3, 5, 9])
    cache = PagedCache(64, BLOCK, num_layers=2, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32,
                       kv_dtype=kv_dtype, kv_window=window)
    rows = rng.randint(1, 3)
    for _ in range(rows):
        cache.add_sequence()
    kept: list[list[list[torch.Tensor]]] = [[[], []] for _ in range(rows)]  # row -> keys, values
    for _ in range(rng.randint(2, 6)):
        new = rng.randint(1, 7)
        k, v = torch.randn(rows, HEADS, new, DIM), torch.randn(rows, HEADS, new, DIM)
        cache.begin(new)
        for layer in cache.layers:  # (both layers get the same rows: the reference is one)
            keys, values = layer.update(k, v)
        for row in range(rows):
            kept[row][0].append(k[row].transpose(0, 1))
            kept[row][1].append(v[row].transpose(0, 1))
            total = cache.row_lengths[row]
            key_type, value_type = kv_dtype.split("/") if "/" in kv_dtype else (kv_dtype, kv_dtype)
            exact_from = max(0, total - window)
            for got, given, kind in ((keys, kept[row][0], key_type), (values, kept[row][1], value_type)):
                expected = expected_reads(given, total, exact_from, kind)
                torch.testing.assert_close(got[row, :, :total], expected, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_window_wider_than_the_rows_reads_what_a_float_pool_reads(dtype):
    sizes = dict(num_layers=1, kv_heads=HEADS, head_dim=DIM, dtype=dtype)
    windowed = PagedCache(32, BLOCK, **sizes, kv_dtype="int4", kv_window=64)
    plain = PagedCache(32, BLOCK, **sizes)
    for new in (5, 1, 1, 9, 1):
        k, v = (torch.randn(2, HEADS, new, DIM).to(dtype) for _ in range(2))
        got, expected = (cache.layers[0].update(k, v) for cache in (windowed, plain))
        assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_an_attached_prefix_and_appended_rows_are_read_as_stored():
    """Rows the row did not write itself (a cached prefix, rows appended from a store) have no
    exact copy: they are read as stored. A hit covers only what lies before the prompt's last
    kv_window tokens (`reusable_tokens`), so a prompt sent again computes and keeps exact what its
    first copy kept exact."""
    sizes = dict(num_layers=1, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, kv_dtype="int8")
    prompt = list(range(9))
    narrow = PagedCache(32, BLOCK, **sizes, kv_window=4)
    narrow.add_sequence(prompt)
    k, v = torch.randn(1, HEADS, 9, DIM), torch.randn(1, HEADS, 9, DIM)
    narrow.layers[0].update(k, v)
    narrow.free_rows()
    assert narrow.reusable_tokens(9) == 5
    assert narrow.add_sequence(prompt) == 5  # a block and a token of the next: the rest is the window's
    k2, v2 = torch.randn(1, HEADS, 4, DIM), torch.randn(1, HEADS, 4, DIM)
    keys, _ = narrow.layers[0].update(k2, v2)
    rows = k[0].transpose(0, 1)[:5]
    torch.testing.assert_close(keys[0, :, :5], as_stored("int8", rows).transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(keys[0, :, 5:9], k2[0], atol=0, rtol=0)

    cache = PagedCache(32, BLOCK, **sizes, kv_window=16)
    cache.add_sequence(prompt)
    cache.layers[0].update(k, v)
    cache.free_rows()
    assert cache.add_sequence(prompt) == 0  # every block lies inside the window: computed again
    keys, _ = cache.layers[0].update(k, v)
    torch.testing.assert_close(keys[0, :, :9], k[0], atol=0, rtol=0)
    keys_in = [as_stored("int8", torch.randn(3, HEADS, DIM)) for _ in range(2)]
    packing = row_format("int8", DIM)
    cache.append_to_row(0, [packing.pack(keys_in[0])], [packing.pack(keys_in[1])])
    k3, v3 = torch.randn(1, HEADS, 1, DIM), torch.randn(1, HEADS, 1, DIM)
    keys, _ = cache.layers[0].update(k3, v3)
    torch.testing.assert_close(keys[0, :, 9:12], keys_in[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(keys[0, :, 12:13], k3[0], atol=0, rtol=0)


def test_forked_rows_keep_their_exact_rows_and_a_crop_keeps_what_the_window_held():
    sizes = dict(num_layers=1, kv_heads=HEADS, head_dim=DIM, dtype=torch.float32, kv_dtype="int4")
    cache = PagedCache(32, BLOCK, **sizes, kv_window=6)
    k, v = torch.randn(1, HEADS, 10, DIM), torch.randn(1, HEADS, 10, DIM)
    cache.layers[0].update(k, v)
    cache.repeat_interleave(2)
    k2, v2 = torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM)
    keys, _ = cache.layers[0].update(k2, v2)
    for row in range(2):
        torch.testing.assert_close(keys[row, :, 6:10], k[0, :, 6:10], atol=0, rtol=0)
        torch.testing.assert_close(keys[row, :, 10:], k2[row], atol=0, rtol=0)
    cache.crop(8)  # the window held 5..10: 5..7 stay exact; 3, 4 are inside the next window, as stored
    k3, v3 = torch.randn(2, HEADS, 1, DIM), torch.randn(2, HEADS, 1, DIM)
    keys, _ = cache.layers[0].update(k3, v3)
    torch.testing.assert_close(keys[0, :, 5:8], k[0, :, 5:8], atol=0, rtol=0)
    torch.testing.assert_close(keys[0, :, 3:5], as_stored("int4", k[0, :, 3:5]), atol=0, rtol=0)


def test_a_window_needs_a_kv_dtype_and_a_count():
    with pytest.raises(CacheConfigError, match="kv_window"):
        PagedCache(8, 4, num_layers=1, kv_window=4)
    for bad in (-1, 2.5, True):
        with pytest.raises(CacheConfigError, match="kv_window"):
            PagedCache(8, 4, num_layers=1, kv_dtype="int8", kv_window=bad)


@pytest.mark.parametrize("kv_dtype", ["bfloat16/int4", "bfloat16"])
def test_a_side_stored_in_the_forwards_dtype_still_keeps_its_window(kv_dtype):
    """One row on consecutive blocks reads a side stored in the forward's dtype as a view of the
    storage (exact already, never written over); the window still keeps that forward's rows, so
    a later forward of several rows reads them exactly."""
    sizes = dict(num_layers=1, kv_heads=HEADS, head_dim=DIM, dtype=torch.bfloat16)
    windowed = PagedCache(32, BLOCK, **sizes, kv_dtype=kv_dtype, kv_window=64)
    plain = PagedCache(32, BLOCK, **sizes)
    k, v = (torch.randn(1, HEADS, 5, DIM).to(torch.bfloat16) for _ in range(2))
    for cache in (windowed, plain):
        cache.layers[0].update(k, v)
        cache.repeat_interleave(2)
    k2, v2 = (torch.randn(2, HEADS, 1, DIM).to(torch.bfloat16) for _ in range(2))
    got, expected = (cache.layers[0].update(k2, v2) for cache in (windowed, plain))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
