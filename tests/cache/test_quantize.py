"""Quantize/dequantize of key/value rows: the analytic error bound, packing, no clipping."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import CacheConfigError
from kvcache.cache.quantize import QuantSpec, dequantize, error_bound, fp8_as_float16, quantize

SPECS = [("int", 8), ("int", 4), ("fp8", 8)]
SCALE_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def with_outliers(shape, seed: int, outliers: int = 6, size: float = 60.0) -> torch.Tensor:
    """Gaussian rows with a few large entries and one whole outlier channel (as keys have)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    flat = x.view(-1)
    where = torch.randint(0, flat.numel(), (outliers,), generator=generator)
    flat[where] = size * torch.randn(outliers, generator=generator)
    x[..., 1] *= 20  # an outlier channel
    return x


def assert_within_bound(x: torch.Tensor, spec: QuantSpec) -> None:
    rows = quantize(x, spec)
    restored = dequantize(rows, spec, torch.float32)
    bound = error_bound(x, rows, spec)
    error = (x - restored).abs()
    slack = 1e-6 * float(x.abs().max()) + 1e-30  # float32 arithmetic of the dequantization
    excess = error - bound * (1 + 1e-5) - slack
    assert float(excess.max()) <= 0, f"{spec}: error exceeds the bound by {float(excess.max())}"


@pytest.mark.parametrize("kind,bits", SPECS)
@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("scale_dtype", SCALE_DTYPES)
def test_round_trip_error_is_within_half_a_step_per_group(kind, bits, axis, scale_dtype):
    x = with_outliers((2, 3, 64, 32), seed=bits)
    assert_within_bound(x, QuantSpec(kind, bits, 16, axis, scale_dtype))


@settings(max_examples=40, deadline=None)
@given(
    spec_index=st.integers(0, len(SPECS) - 1),
    axis=st.sampled_from(["token", "channel"]),
    group_size=st.sampled_from([1, 2, 4, 8, 16]),
    groups=st.integers(1, 3),
    dim=st.sampled_from([2, 8, 16]),
    magnitude=st.sampled_from([1e-4, 1.0, 300.0]),
    seed=st.integers(0, 2**16),
)
def test_round_trip_bound_holds_for_any_shape_and_scale(
    spec_index, axis, group_size, groups, dim, magnitude, seed
):
    kind, bits = SPECS[spec_index]
    if axis == "token" and dim % min(group_size, dim):
        return
    tokens = group_size * groups if axis == "channel" else groups
    x = with_outliers((1, 2, tokens, dim), seed=seed, outliers=2) * magnitude
    assert_within_bound(x, QuantSpec(kind, bits, group_size, axis))


@pytest.mark.parametrize("kind,bits", SPECS)
def test_a_later_outlier_gets_its_own_scale_and_is_not_clipped(kind, bits):
    spec = QuantSpec(kind, bits, 8, "token")
    calm = torch.randn(1, 1, 8, 16) * 0.01
    first = quantize(calm, spec)
    later = calm.clone()
    later[0, 0, 3, 5] = 1000.0  # 10^5 times the earlier range
    rows = quantize(later, spec)
    restored = dequantize(rows, spec, torch.float32)
    assert float(restored[0, 0, 3, 5]) == pytest.approx(1000.0, rel=0.07)
    assert float(rows.scale.max()) > 100 * float(first.scale.max())
    assert_within_bound(later, spec)


def test_int4_packs_two_codes_per_byte_and_int8_one():
    x = torch.randn(1, 2, 16, 8)
    int4 = quantize(x, QuantSpec("int", 4, 8, "channel"))
    int8 = quantize(x, QuantSpec("int", 8, 8, "channel"))
    assert int4.data.dtype == torch.uint8 and int4.data.shape == (1, 2, 16, 4)
    assert int8.data.shape == (1, 2, 16, 8)
    assert int4.scale.shape == int4.zero.shape == (1, 2, 2, 8)  # one per channel per 8 tokens
    low, high = int4.data & 0x0F, int4.data >> 4
    assert int(low.max()) <= 15 and int(high.max()) <= 15
    assert int(torch.cat([low, high]).max()) == 15 and int(torch.cat([low, high]).min()) == 0


def test_fp8_stores_e4m3_with_one_scale_per_group_and_no_zero_point():
    rows = quantize(torch.randn(1, 1, 4, 32), QuantSpec("fp8", 8, 16, "token"))
    assert rows.data.dtype == torch.float8_e4m3fn and rows.zero is None
    assert rows.scale.shape == (1, 1, 4, 2)
    assert float(rows.data.float().abs().amax(-1).max()) <= 448


def test_constant_and_zero_groups_round_trip_exactly():
    for kind, bits in SPECS:
        spec = QuantSpec(kind, bits, 4, "token")
        x = torch.zeros(1, 1, 2, 8)
        x[0, 0, 1] = 2.5
        assert torch.equal(dequantize(quantize(x, spec), spec, torch.float32), x)


def test_fp8_decoding_by_moving_bits_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # the two NaN codes are never stored
    fp8 = codes.view(torch.float8_e4m3fn)
    assert torch.equal(fp8_as_float16(fp8).float() * 256, fp8.float())


@pytest.mark.parametrize(
    "arguments,message",
    [
        (dict(kind="int", bits=3), "bits"),
        (dict(kind="fp8", bits=4), "bits"),
        (dict(kind="nf4"), "kind"),
        (dict(axis="head"), "axis"),
        (dict(group_size=0), "group_size"),
        (dict(scale_dtype=torch.int8), "scale_dtype"),
    ],
)
def test_bad_specs_raise_a_named_error(arguments, message):
    with pytest.raises(CacheConfigError, match=message):
        QuantSpec(**arguments)


def test_shapes_the_groups_cannot_tile_raise():
    with pytest.raises(CacheConfigError, match="head_dim must be even"):
        quantize(torch.randn(1, 1, 4, 7), QuantSpec("int", 4, 7, "token"))
    with pytest.raises(CacheConfigError, match="not a multiple of group_size"):
        quantize(torch.randn(1, 1, 4, 12), QuantSpec("int", 8, 8, "token"))
    with pytest.raises(CacheConfigError, match="multiple of group_size=8 tokens"):
        quantize(torch.randn(1, 1, 12, 8), QuantSpec("int", 8, 8, "channel"))


@pytest.mark.parametrize("kind,bits", SPECS)
def test_a_bfloat16_result_is_the_float32_result_rounded_once(kind, bits):
    spec = QuantSpec(kind, bits, 8, "channel", torch.bfloat16)
    rows = quantize(with_outliers((1, 2, 16, 8), seed=4).bfloat16(), spec)
    exact = dequantize(rows, spec, torch.float32)
    assert torch.equal(dequantize(rows, spec, torch.bfloat16), exact.bfloat16())
