"""A stored block's bytes: read back exactly, and refused for any field, byte or digest that does
not match (never unpickled, never used half-checked)."""

from __future__ import annotations

import struct

import pytest
import torch
from tiny_models import tiny_model

from kvcache.cache.paged.formats import row_formats
from kvcache.tiers.block_codec import InvalidBlock, decode_block, encode_block, layout_of, namespace

DIGEST = bytes(range(16))
SPACE = "ab" * 16


@pytest.fixture(params=[torch.float32, torch.bfloat16, "int8", "int4", "int4/int8", "fp8", "bfloat16/int4",
                        "float16"])
def block(request):
    """(layout, keys, values, the encoded block) of a pool in the model's dtype, or in a kv_dtype
    (each side in its row format: packed rows, or floats of their own)."""
    in_kv_dtype = isinstance(request.param, str)
    model = tiny_model().to(torch.float32 if in_kv_dtype else request.param)
    layout = layout_of(model, 4, request.param if in_kv_dtype else None)
    shape = (layout.layers, 4, layout.kv_heads, layout.head_dim)
    keys, values = torch.randn(shape).to(model.dtype), torch.randn(shape).to(model.dtype)
    if in_kv_dtype:
        key_format, value_format = row_formats(request.param, layout.head_dim, layout.head_dim)
        keys, values = key_format.pack(keys), value_format.pack(values)
        row_bytes = (keys.shape[-1] * keys.element_size(), values.shape[-1] * values.element_size())
        assert row_bytes == layout.row_bytes
    return layout, keys, values, encode_block(layout, SPACE, DIGEST, keys, values)


def test_a_block_reads_back_exactly(block):
    layout, keys, values, value = block
    assert len(value) == layout.value_bytes
    got_keys, got_values = decode_block(layout, SPACE, DIGEST, value)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


@pytest.mark.parametrize("offset", [0, 4, 6, 8, 10, 12, 14, 16, 18, 20, 40, 56, 72, -1])
def test_any_changed_byte_is_refused(block, offset):
    layout, _, _, value = block
    damaged = bytearray(value)
    damaged[offset] ^= 0x01
    with pytest.raises(InvalidBlock):
        decode_block(layout, SPACE, DIGEST, bytes(damaged))


def test_a_block_under_another_digest_a_short_value_or_non_finite_numbers_are_refused(block):
    layout, keys, values, value = block
    with pytest.raises(InvalidBlock, match="does not match"):
        decode_block(layout, SPACE, bytes(16), value)
    with pytest.raises(InvalidBlock, match="bytes, got"):
        decode_block(layout, SPACE, DIGEST, value[:-1])
    with pytest.raises(InvalidBlock, match="bytes, got NoneType"):
        decode_block(layout, SPACE, DIGEST, None)
    poisoned = keys.clone()
    if keys.dtype.is_floating_point:
        poisoned[0, 0, 0, 0] = float("nan")
    else:  # a row's float16 scale: NaN
        poisoned[0, 0, 0, -4:-2] = torch.tensor([float("nan")], dtype=torch.float16).view(keys.dtype)
    with pytest.raises(InvalidBlock, match="non-finite"):
        decode_block(layout, SPACE, DIGEST, encode_block(layout, SPACE, DIGEST, poisoned, values))
    if layout.row_dtypes[0] == "fp8":  # an fp8 code that is NaN (0x7F), its scale finite
        poisoned = keys.clone()
        poisoned[0, 0, 0, 3] = 0x7F
        with pytest.raises(InvalidBlock, match="NaN codes"):
            decode_block(layout, SPACE, DIGEST, encode_block(layout, SPACE, DIGEST, poisoned, values))


def test_the_header_is_fixed_and_names_the_layout(block):
    layout, _, _, value = block
    magic, version, key_format, value_format, layers, heads, dim, _, size = struct.unpack_from(
        "<4sHBBHHHHH", value)
    assert (magic, version, layers, heads, dim, size) == (b"KVB3", 3, layout.layers, layout.kv_heads,
                                                         layout.head_dim, 4)
    codes = {"float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "int4": 5, "fp8": 6}
    assert (key_format, value_format) == tuple(codes[side] for side in layout.row_dtypes)


def test_namespaces_differ_by_weights_dtype_and_block_size():
    first, second, third = tiny_model(seed=0), tiny_model(seed=0), tiny_model(seed=0)
    assert namespace(first, layout_of(first, 4)) == namespace(second, layout_of(second, 4))
    with torch.no_grad():
        third.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # one value, deep inside
    half = tiny_model(seed=0).to(torch.bfloat16)
    cases = ((first, 4), (third, 4), (first, 8), (half, 4))
    assert len({namespace(model, layout_of(model, size)) for model, size in cases}) == 4


def test_another_models_valid_block_copied_under_this_models_key_is_refused():
    ours, theirs = tiny_model(seed=0), tiny_model(seed=1)  # one geometry, other weights
    layout = layout_of(ours, 4)
    assert layout == layout_of(theirs, 4)
    shape = (layout.layers, 4, layout.kv_heads, layout.head_dim)
    keys, values = torch.randn(shape), torch.randn(shape)
    copied = encode_block(layout, namespace(theirs, layout), DIGEST, keys, values)  # valid: its own
    decode_block(layout, namespace(theirs, layout), DIGEST, copied)
    with pytest.raises(InvalidBlock, match="another model's block"):
        decode_block(layout, namespace(ours, layout), DIGEST, copied)


def test_values_after_keys_of_an_odd_byte_count_read_back():
    """int4 keys of 4 channels (6 bytes a row) in blocks of 3: the float32 values start at byte 18,
    not a multiple of 4, and still read back exactly."""
    from kvcache.tiers.block_codec import BlockLayout

    layout = BlockLayout(1, 1, 4, 4, 3, torch.float32, "int4/float32")
    key_format, value_format = row_formats("int4/float32", 4, 4)
    keys = key_format.pack(torch.randn(1, 3, 1, 4))
    values = value_format.pack(torch.randn(1, 3, 1, 4))
    value = encode_block(layout, SPACE, DIGEST, keys, values)
    got_keys, got_values = decode_block(layout, SPACE, DIGEST, value)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)
