"""QuantizedLayer / QuantizedCache behind the cache seam: flush boundaries, masks, bytes, batch
operations, crop, errors."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache import (
    CacheConfigError,
    CacheCropError,
    CacheDtypeError,
    CacheShapeError,
    DynamicCache,
    QuantizedCache,
    QuantizedLayer,
    SlidingWindowLayer,
    make_cache,
)
from kvcache.cache.quantize import QuantSpec, dequantize, quantize
from kvcache.memory import quantized_kv_cache_bytes

BITS = [8, 4, "fp8"]
GROUP, RESIDUAL = 4, 6


def kv(tokens: int, batch: int = 2, heads: int = 2, dim: int = 8, seed: int = 0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, tokens, dim)
    keys, values = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    return keys.to(dtype), values.to(dtype)


def spec_of(bits, axis: str, scale_dtype=torch.float32) -> QuantSpec:
    kind, width = ("fp8", 8) if bits == "fp8" else ("int", bits)
    return QuantSpec(kind, width, GROUP, axis, scale_dtype)


def quantized_at_once(x: torch.Tensor, bits, axis: str, residual: int = RESIDUAL) -> torch.Tensor:
    """What the cache must hold for x: its first floor((T - R) / g) · g tokens quantized in
    one call of the pure function, the rest as given."""
    tokens = x.shape[2]
    count = max(0, (tokens - residual) // GROUP * GROUP)
    if count == 0:
        return x
    spec = spec_of(bits, axis)
    head = dequantize(quantize(x[:, :, :count], spec), spec, x.dtype)
    return torch.cat([head, x[:, :, count:]], dim=2)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize(
    "length", [RESIDUAL - 1, RESIDUAL, RESIDUAL + 1, 2 * RESIDUAL + 1, 3 * RESIDUAL + GROUP]
)
def test_flush_boundaries_give_the_same_result_as_quantizing_at_once(bits, length):
    k, v = kv(length, seed=length)
    expected_k, expected_v = quantized_at_once(k, bits, "channel"), quantized_at_once(v, bits, "token")
    options = dict(bits=bits, group_size=GROUP, residual_length=RESIDUAL)
    whole = QuantizedLayer(**options)
    keys, values = whole.update(k, v)
    stepwise = QuantizedLayer(**options)
    for t in range(length):
        step_keys, step_values = stepwise.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    chunked = QuantizedLayer(**options)
    for start in range(0, length, 5):
        chunk_keys, chunk_values = chunked.update(k[:, :, start : start + 5], v[:, :, start : start + 5])
    for got_k, got_v in [(keys, values), (step_keys, step_values), (chunk_keys, chunk_values)]:
        assert torch.equal(got_k, expected_k) and torch.equal(got_v, expected_v)
    quantized = max(0, (length - RESIDUAL) // GROUP * GROUP)
    assert whole.quantized_tokens == stepwise.quantized_tokens == chunked.quantized_tokens == quantized
    assert stepwise.residual_tokens == length - quantized
    assert RESIDUAL <= stepwise.residual_tokens < RESIDUAL + GROUP or length < RESIDUAL + GROUP


@pytest.mark.parametrize("bits", BITS)
def test_no_flush_means_exact_keys_and_values(bits):
    layer = QuantizedLayer(bits=bits, group_size=GROUP, residual_length=RESIDUAL)
    k, v = kv(RESIDUAL + GROUP - 1)
    keys, values = layer.update(k, v)
    assert layer.quantized_tokens == 0
    assert torch.equal(keys, k) and torch.equal(values, v)


def test_a_flush_never_requantizes_what_is_already_stored():
    layer = QuantizedLayer(bits=4, group_size=GROUP, residual_length=0)
    k, v = kv(GROUP)
    layer.update(k, v)
    assert layer._key_store is not None
    first_codes = layer._key_store.rows().data.clone()
    for step in range(3 * GROUP):
        big_k, big_v = kv(1, seed=100 + step)
        layer.update(100 * big_k, 100 * big_v)  # later tokens with a much larger range
    assert torch.equal(layer._key_store.rows().data[:, :, :GROUP], first_codes)


@pytest.mark.parametrize("bits", BITS)
def test_a_later_outlier_token_is_not_clipped(bits):
    layer = QuantizedLayer(bits=bits, group_size=GROUP, residual_length=0)
    k, v = kv(2 * GROUP, seed=3)
    k, v = 0.01 * k, 0.01 * v
    k[:, :, GROUP + 1, 3] = 500.0
    v[:, :, GROUP + 2, 5] = -500.0
    for t in range(2 * GROUP):
        keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert layer.quantized_tokens == 2 * GROUP
    assert torch.allclose(keys[:, :, GROUP + 1, 3], torch.full((2, 2), 500.0), rtol=0.07)
    assert torch.allclose(values[:, :, GROUP + 2, 5], torch.full((2, 2), -500.0), rtol=0.07)


@pytest.mark.parametrize("bits", BITS)
def test_masks_and_lengths_match_a_dynamic_cache(bits):
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8}
    quantized = make_cache("quantized", config=config, bits=bits, group_size=GROUP, residual_length=2)
    dynamic = DynamicCache(config=config)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    for new in (7, 1, 1, 3, 1):
        if quantized.get_seq_length():
            ones = torch.ones(2, new, dtype=torch.long)
            attention_mask = torch.cat([attention_mask, ones], dim=1)
        got = quantized.attention_masks(new, attention_mask)
        want = dynamic.attention_masks(new, attention_mask)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert torch.equal(quantized.positions(new), dynamic.positions(new))
        for layer in range(2):
            k, v = kv(new, seed=new + layer)
            keys, values = quantized.update(k, v, layer)
            full_keys, _ = dynamic.update(k, v, layer)
            assert keys.shape == full_keys.shape and keys.dtype == full_keys.dtype
            assert keys.shape[2] == got[layer].shape[-1]
        assert quantized.get_seq_length() == dynamic.get_seq_length()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("axes", [("channel", "token"), ("token", "channel")])
@pytest.mark.parametrize("dtype,name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")])
def test_nbytes_used_is_what_the_memory_planner_predicts(bits, axes, dtype, name):
    cache = QuantizedCache(3, bits=bits, group_size=GROUP, residual_length=RESIDUAL,
                           key_axis=axes[0], value_axis=axes[1])
    for tokens in (3, 9, 1, 1, 14):
        for layer in range(3):
            cache.update(*kv(tokens, dtype=dtype), layer)
        length = cache.get_seq_length()
        predicted = quantized_kv_cache_bytes(3, 2, length, 8, 2, bits=bits, group_size=GROUP,
                                             residual_length=RESIDUAL, dtype=name,
                                             key_axis=axes[0], value_axis=axes[1])
        assert cache.nbytes_used == predicted
        assert cache.nbytes >= cache.nbytes_used


def test_scale_dtype_changes_only_the_scale_bytes():
    small = QuantizedLayer(bits=8, group_size=GROUP, residual_length=0, scale_dtype=torch.float16)
    large = QuantizedLayer(bits=8, group_size=GROUP, residual_length=0)
    k, v = kv(4 * GROUP)
    small.update(k, v)
    large.update(k, v)
    predicted = quantized_kv_cache_bytes(1, 2, 4 * GROUP, 8, 2, bits=8, group_size=GROUP, residual_length=0,
                                         dtype="float32", scale_dtype="float16")
    assert small.nbytes_used == predicted < large.nbytes_used
    assert small._key_store is not None and small._key_store.rows().scale.dtype == torch.float16


def test_int4_stores_fewer_bytes_than_int8_and_both_fewer_than_full_precision():
    sizes = {}
    for bits in (8, 4, "fp8"):
        layer = QuantizedLayer(bits=bits, group_size=32, residual_length=0)
        layer.update(*kv(64, dim=64))
        sizes[bits] = layer.nbytes_used
    full = 2 * 2 * 2 * 64 * 64 * 4
    assert sizes[4] < sizes["fp8"] <= sizes[8] < full / 3


@pytest.mark.parametrize("bits", BITS)
def test_select_reorder_and_repeat_move_every_part_of_a_row(bits):
    cache = QuantizedCache(1, bits=bits, group_size=GROUP, residual_length=2)
    k, v = kv(11, batch=3)
    keys, values = cache.update(k, v, 0)
    cache.reorder(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.layers[0].keys, keys[[2, 0, 1]])
    cache.select([1])
    assert torch.equal(cache.layers[0].values, values[[0]])
    cache.repeat_interleave(2)
    more_k, more_v = kv(5, batch=2, seed=9)
    got_keys, _ = cache.update(more_k, more_v, 0)
    reference = QuantizedLayer(bits=bits, group_size=GROUP, residual_length=2)
    reference.update(k[[0, 0]], v[[0, 0]])
    want_keys, _ = reference.update(more_k, more_v)
    assert torch.equal(got_keys, want_keys)


def test_crop_drops_full_precision_tokens_and_refuses_quantized_ones():
    cache = QuantizedCache(2, bits=8, group_size=GROUP, residual_length=RESIDUAL)
    k, v = kv(13)
    for layer in range(2):
        keys, _ = cache.update(k, v, layer)
    assert cache.layers[0].quantized_tokens == 4
    cache.crop(7)
    assert cache.get_seq_length() == 7 and torch.equal(cache.layers[1].keys, keys[:, :, :7])
    with pytest.raises(CacheCropError, match="crop to >= 4"):
        cache.crop(3)
    assert cache.get_seq_length() == 7  # all or nothing
    cache.crop(100)
    assert cache.get_seq_length() == 7
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes > 0


def test_sliding_layers_of_a_config_stay_a_full_precision_ring():
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "sliding_window": 4,
              "layer_types": ["full_attention", "sliding_attention"]}
    cache = make_cache("quantized", config=config, bits=4, group_size=GROUP, residual_length=0)
    assert isinstance(cache.layers[0], QuantizedLayer) and isinstance(cache.layers[1], SlidingWindowLayer)


def test_bad_use_raises_named_errors():
    with pytest.raises(CacheConfigError, match="bits must be one of"):
        QuantizedCache(bits=2)
    with pytest.raises(CacheConfigError, match="residual_length"):
        QuantizedLayer(residual_length=-1)
    with pytest.raises(CacheConfigError, match="axis"):
        make_cache("quantized", num_layers=1, key_axis="head")
    with pytest.raises(CacheConfigError, match="apply to kind 'quantized' only"):
        make_cache("dynamic", bits=4)
    layer = QuantizedLayer(bits=4, group_size=GROUP)
    with pytest.raises(CacheShapeError, match="head_dim must be even"):
        layer.update(*kv(1, dim=7))
    layer = QuantizedLayer(bits=8, group_size=GROUP)
    layer.update(*kv(1))
    with pytest.raises(CacheDtypeError):
        layer.update(*kv(1, dtype=torch.float16))
    with pytest.raises(CacheShapeError):
        layer.update(*kv(1, dim=4))


def test_memory_planner_counts_codes_scales_zero_points_and_residual_by_hand():
    # 2 layers, 4 kv heads, head_dim 64, 300 tokens, group 64, residual 128: 128 tokens packed
    # (300 - 128 = 172 → two groups), 172 in bfloat16.
    packed_codes = 128 * 64 * 4 // 8  # int4, per head, K or V
    key_params = 128 // 64 * 64 * 2 * 2  # per channel per group: scale + zero point, bf16
    value_params = 128 * 1 * 2 * 2  # per token, one group of 64 channels
    residual = 172 * 64 * 2 * 2  # K and V rows in bf16
    per_layer_head = 2 * packed_codes + key_params + value_params + residual
    assert quantized_kv_cache_bytes(2, 4, 300, 64, bits=4, group_size=64, residual_length=128,
                                    dtype="bfloat16") == 2 * 4 * per_layer_head
    assert quantized_kv_cache_bytes(2, 4, 191, 64, residual_length=128, dtype="bfloat16") == (
        2 * 4 * 191 * 64 * 2 * 2  # 191 - 128 < 64: nothing is packed yet
    )
    with pytest.raises(ValueError, match="bits"):
        quantized_kv_cache_bytes(1, 1, 1, 8, bits=2)
    with pytest.raises(ValueError, match="axes"):
        quantized_kv_cache_bytes(1, 1, 1, 8, key_axis="head")


def test_after_a_crop_the_residual_regrows_and_the_flush_invariant_returns():
    layer = QuantizedLayer(bits=8, group_size=GROUP, residual_length=RESIDUAL)
    k, v = kv(30)
    layer.update(k[:, :, :20], v[:, :, :20])
    assert layer.quantized_tokens == 12
    layer.crop(13)  # one full-precision token left
    keys, _ = layer.update(k[:, :, 13:30], v[:, :, 13:30])
    assert layer.quantized_tokens == (30 - RESIDUAL) // GROUP * GROUP
    assert torch.equal(keys, quantized_at_once(k, 8, "channel"))
