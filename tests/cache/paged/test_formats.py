"""Paged blocks in a kv_dtype (`PagedCache(kv_dtype=...)`, `formats`): each packed row is one group
of `quantize`'s arithmetic (fp8, int8, int4), within its bound of the exact row; a float row is the
row cast; the cache returns what it stored; its bytes are what `kvcache.memory` counts; rows copied,
shared, read out and loaded stay as stored."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import CacheConfigError, CacheDtypeError, CacheShapeError, PagedCache
from kvcache.cache.paged.formats import FloatRows, PackedRows, row_format
from kvcache.cache.quantize import QuantSpec, dequantize, error_bound, quantize
from kvcache.memory import KVShape, paged_block_bytes, paged_row_bytes


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(["int8", "int4", "fp8"]), dim=st.sampled_from([2, 8, 64, 128]),
       rows=st.integers(1, 40), spread=st.floats(1e-3, 1e3), seed=st.integers(0, 2**16))
def test_a_packed_row_is_one_group_within_its_bound(name, dim, rows, spread, seed):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, dim, generator=generator) * spread
    x[0, 0] = 7.0 if name != "fp8" else 0.0  # a constant row (fp8: of zeros), stored exactly
    packing = PackedRows(name, dim)
    packed = packing.pack(x)
    code_bytes = dim // 2 if name == "int4" else dim
    expected_dtype = torch.int8 if name == "fp8" else torch.uint8  # (how the kernels tell them apart)
    assert packed.shape == (rows, 3, code_bytes + 4) and packed.dtype == expected_dtype
    assert packed.shape[-1] == paged_row_bytes(dim, name) and packing.valid(packed)
    restored = packing.unpack(packed, torch.float32)
    kind, bits = ("fp8", 8) if name == "fp8" else ("int", int(name[3:]))
    spec = QuantSpec(kind, bits, group_size=dim, scale_dtype=torch.float16)
    reference = quantize(x.reshape(1, 1, -1, dim), spec)  # the quantized layers' arithmetic
    expected = dequantize(reference, spec, torch.float32).reshape(x.shape)
    torch.testing.assert_close(restored, expected, atol=0, rtol=0)
    bound = error_bound(x.reshape(1, 1, -1, dim), reference, spec).reshape(x.shape)
    arithmetic = x.abs().amax(dim=-1, keepdim=True) * 2**-20  # (x̂ = code · scale + zero in float32)
    assert bool(((x - restored).abs() <= bound + arithmetic).all())
    assert torch.equal(restored[0, 0], x[0, 0])


def test_unpacking_rows_of_another_width_is_refused():
    with pytest.raises(CacheConfigError, match=r"\(\.\.\., 68\) torch.uint8"):
        PackedRows("int8", 64).unpack(torch.zeros(2, 36, dtype=torch.uint8), torch.float32)
    with pytest.raises(CacheConfigError, match=r"\(\.\.\., 68\) torch.int8"):  # fp8 codes are int8 bytes
        PackedRows("fp8", 64).unpack(torch.zeros(2, 68, dtype=torch.uint8), torch.float32)
    with pytest.raises(CacheConfigError, match="int4 packs two channels"):
        PackedRows("int4", 7)
    with pytest.raises(CacheConfigError, match="packed row is one of"):
        PackedRows("bfloat16", 8)
    with pytest.raises(CacheConfigError, match="kv_dtype"):
        PagedCache(4, 4, num_layers=1, kv_dtype="int3")


@pytest.mark.parametrize("kv_dtype, row_bytes", [("int8", 20), ("int4", 12), ("fp8", 20), ("float16", 32),
                                                  ("float32", 64)])
def test_the_cache_returns_what_it_stored_and_holds_the_bytes_memory_counts(kv_dtype, row_bytes):
    torch.manual_seed(0)
    cache = PagedCache(16, 4, num_layers=2, kv_heads=2, head_dim=16, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    exact = PagedCache(16, 4, num_layers=2, kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    packing = row_format(kv_dtype, 16)
    history = []
    for count in (6, 1, 1, 5):  # a prompt, then decode steps, then a chunk
        k, v = (torch.randn(2, 2, count, 16, dtype=torch.bfloat16) for _ in "kv")
        history.append((k, v))
        for layer in range(2):
            keys, values = cache.update(k, v, layer)
            exact.update(k, v, layer)
        assert keys.dtype == torch.bfloat16  # read back in the forward's dtype
        every_k = torch.cat([k for k, _ in history], dim=2)
        every_v = torch.cat([v for _, v in history], dim=2)
        for got, every in ((keys, every_k), (values, every_v)):
            expected = packing.unpack(packing.pack(every), torch.bfloat16)
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch.testing.assert_close(cache.layers[1].keys, keys, atol=0, rtol=0)
    shape = KVShape(layers=2, kv_heads=2, head_dim=16)
    held = cache.allocator.num_in_use
    assert cache.nbytes_used == held * paged_block_bytes(shape, 4, kv_dtype)
    # a bfloat16 row of 16 channels is 32 bytes; packed, 16 or 8 bytes of codes and 4 of scales
    assert cache.nbytes_used * 32 == exact.nbytes_used * row_bytes


def test_packed_rows_are_read_out_and_loaded_as_stored_and_refused_by_a_float_cache():
    torch.manual_seed(1)
    sizes = dict(num_layers=2, kv_heads=1, head_dim=8, dtype=torch.float32)
    cache = PagedCache(8, 4, **sizes, kv_dtype="int8")
    cache.add_sequence(list(range(6)), reuse_prefix=False)
    for layer in range(2):
        cache.update(torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), layer)
    state = cache.row_state(0)
    assert state.keys[0].dtype == torch.uint8 and state.keys[0].shape == (6, 1, 12)
    other = PagedCache(8, 4, **sizes, kv_dtype="int8")
    other.load_row_state(state)
    torch.testing.assert_close(other.layers[0].values, cache.layers[0].values, atol=0, rtol=0)
    with pytest.raises(CacheShapeError):
        PagedCache(8, 4, **sizes).load_row_state(state)


def test_a_shared_partial_block_is_copied_packed_on_write():
    torch.manual_seed(2)
    cache = PagedCache(8, 4, num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32, kv_dtype="int4")
    cache.add_sequence()
    cache.update(torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), 0)
    before = cache.layers[0].keys.clone()
    cache.fork(0)
    new = torch.randn(2, 1, 1, 8)
    keys, _ = cache.update(new, new, 0)
    torch.testing.assert_close(keys[:, :, :6], before.expand(2, -1, -1, -1), atol=0, rtol=0)
    assert not torch.equal(keys[0, :, 6], keys[1, :, 6])


def test_keys_and_values_may_be_packed_apart():
    cache = PagedCache(8, 4, num_layers=1, kv_heads=2, head_dim=16, dtype=torch.float32, kv_dtype="int8/int4")
    keys, values = cache.layers[0].storage_rows()
    assert (keys.shape[-1], values.shape[-1]) == (16 + 4, 8 + 4) and cache.kv_dtype == "int8/int4"
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    got_k, got_v = cache.update(k, v, 0)
    for got, x, kind in ((got_k, k, "int8"), (got_v, v, "int4")):
        packing = row_format(kind, 16)
        torch.testing.assert_close(got, packing.unpack(packing.pack(x), torch.float32), atol=0, rtol=0)
    shape = KVShape(layers=1, kv_heads=2, head_dim=16)
    assert paged_block_bytes(shape, 4, "int8/int4") == 4 * 2 * (20 + 12) == cache.nbytes // 8
    assert PagedCache(8, 4, num_layers=1, kv_dtype="int4/int4").kv_dtype == "int4"
    with pytest.raises(CacheConfigError, match="keys/values pair"):
        PagedCache(8, 4, num_layers=1, kv_dtype="int8/float64")


def test_a_float_side_and_a_packed_side_in_one_cache():
    """bfloat16 keys with int4 values (K is the more sensitive side): each side stored in its own
    format, read back in the forward's dtype, bytes as memory counts them."""
    cache = PagedCache(8, 4, num_layers=1, kv_heads=2, head_dim=16, dtype=torch.float32,
                       kv_dtype="bf16/int4")
    assert cache.kv_dtype == "bfloat16/int4"
    keys, values = cache.layers[0].storage_rows()
    assert (keys.shape[-1], values.shape[-1]) == (16, 8 + 4)
    k, v = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    got_k, got_v = cache.update(k, v, 0)
    torch.testing.assert_close(got_k, k.to(torch.bfloat16).float(), atol=0, rtol=0)
    assert got_v.dtype == torch.float32 and not torch.equal(got_v, v)
    assert isinstance(cache.layers[0].formats[0], FloatRows)
    shape = KVShape(layers=1, kv_heads=2, head_dim=16)
    assert paged_block_bytes(shape, 4, "bfloat16/int4") == 4 * 2 * (32 + 12) == cache.nbytes // 8


def test_an_fp8_nan_code_a_nan_scale_or_a_nonzero_fp8_zero_is_not_valid():
    packing = PackedRows("fp8", 8)
    packed = packing.pack(torch.randn(3, 8))
    assert packing.valid(packed)
    for code in (0x7F, -1):  # 0x7F and 0xFF (as an int8 byte, -1): e4m3fn's NaNs
        bad = packed.clone()
        bad[1, 2] = code
        assert not packing.valid(bad)
    bad = packed.clone()
    bad[0, -4:-2] = torch.tensor([float("nan")], dtype=torch.float16).view(torch.int8)
    assert not packing.valid(bad)
    bad = packed.clone()  # a finite zero the seam would ignore and the kernels add
    bad[2, -2:] = torch.tensor([0.5], dtype=torch.float16).view(torch.int8)
    assert not packing.valid(bad)


def test_a_row_whose_values_are_not_the_caches_values_dtype_is_refused_and_nothing_changes():
    """A mixed cache checks each side's dtype: int8 values offered to a cache whose values are
    packed int4 (uint8 bytes) are refused by name before a row is added or a block reserved."""
    sizes = dict(num_layers=1, kv_heads=1, head_dim=8, dtype=torch.float32)
    cache = PagedCache(8, 4, **sizes, kv_dtype="bfloat16/int4")
    cache.add_sequence(list(range(5)), reuse_prefix=False)
    cache.update(torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8), 0)
    state = cache.row_state(0)
    assert (state.keys[0].dtype, state.values[0].dtype) == (torch.bfloat16, torch.uint8)
    state.values[0] = state.values[0].view(torch.int8)
    target = PagedCache(8, 4, **sizes, kv_dtype="bfloat16/int4")
    with pytest.raises(CacheDtypeError, match="dtypes torch.bfloat16, torch.int8"):
        target.load_row_state(state)
    assert target.rows == [] and target.allocator.num_in_use == 0
