"""torch.compile: a compiled decode step through a compiled static or sliding cache
(`compiled=True`: whole buffers, the write position in a tensor) matches an eager cache and is
compiled once, not once per step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

from kvcache.cache import make_cache

KV_HEADS, DIM, LAYERS = 2, 8, 2
CONFIG = {"num_hidden_layers": LAYERS, "num_key_value_heads": KV_HEADS, "head_dim": DIM}


def decode_step(cache, q, k, v):
    """One forward through every layer: positions and masks first, then update + attention
    per layer. The positions scale q, standing in for RoPE."""
    positions = cache.positions(q.shape[2])  # (T_new,)
    q = q * (1.0 + positions.to(q.dtype)[:, None] / 64)
    masks = cache.attention_masks(q.shape[2])
    outputs = []
    for layer in range(len(cache.layers)):
        keys, values = cache.update(k[layer], v[layer], layer)
        outputs.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[layer]))
    return torch.stack(outputs)  # (LAYERS, B, H, T_new, D)


def make(kind: str, compiled: bool):
    sizes = {"config": CONFIG, "max_batch_size": 1, "dtype": torch.float32, "compiled": compiled}
    if kind == "static":
        return make_cache("static", max_cache_len=32, **sizes)
    return make_cache("sliding", window=4, **sizes)


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_compiled_decode_matches_eager_and_compiles_once(kind):
    torch._dynamo.reset()
    eager, compiled = make(kind, False), make(kind, True)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(decode_step, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(0)

    def sample(tokens):
        q = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        k = torch.randn(LAYERS, 1, KV_HEADS, tokens, DIM, generator=generator)
        v = torch.randn(LAYERS, 1, KV_HEADS, tokens, DIM, generator=generator)
        return q, k, v

    prefill = sample(6)  # eager prefill in both caches
    torch.testing.assert_close(decode_step(compiled, *prefill), decode_step(eager, *prefill))
    for _ in range(12):  # crosses the sliding window's wrap-around
        inputs = sample(1)
        expected = decode_step(eager, *inputs)
        got = step(compiled, *inputs)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert counter.frame_count == 1
    assert compiled.get_seq_length() == eager.get_seq_length() == 18
    # eager use after compiled steps sees the compiled writes
    torch.testing.assert_close(compiled.layers[0].keys, eager.layers[0].keys)
    inputs = sample(3)
    torch.testing.assert_close(decode_step(compiled, *inputs), decode_step(eager, *inputs))


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_compiled_chunk_after_wraparound_matches_eager(kind):
    torch._dynamo.reset()
    eager, compiled = make(kind, False), make(kind, True)
    step = torch.compile(decode_step, backend="aot_eager", fullgraph=True)
    generator = torch.Generator().manual_seed(1)
    for tokens in (6, 3, 5):  # chunks that cross the ring's end (window 4)
        q = torch.randn(1, KV_HEADS, tokens, DIM, generator=generator)
        k = torch.randn(LAYERS, 1, KV_HEADS, tokens, DIM, generator=generator)
        v = torch.randn(LAYERS, 1, KV_HEADS, tokens, DIM, generator=generator)
        torch.testing.assert_close(
            step(compiled, q, k, v), decode_step(eager, q, k, v), atol=1e-5, rtol=0
        )
    assert compiled.get_seq_length() == 14
    torch.testing.assert_close(compiled.layers[1].values, eager.layers[1].values)


def masked_step(cache, q, k, v, attention_mask):
    """decode_step with a left-padding attention mask (B, past + new)."""
    masks = cache.attention_masks(q.shape[2], attention_mask)
    outputs = []
    for layer in range(len(cache.layers)):
        keys, values = cache.update(k[layer], v[layer], layer)
        outputs.append(F.scaled_dot_product_attention(q, keys, values, attn_mask=masks[layer]))
    return torch.stack(outputs)


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_compiled_padded_batch_matches_eager_with_one_recompilation(kind):
    torch._dynamo.reset()
    sizes = {"config": CONFIG, "max_batch_size": 2, "dtype": torch.float32}
    extra = {"max_cache_len": 32} if kind == "static" else {"window": 4}
    eager, compiled = make_cache(kind, **sizes, **extra), make_cache(kind, **sizes, **extra, compiled=True)
    counter = CompileCounterWithBackend("aot_eager")
    step = torch.compile(masked_step, backend=counter, fullgraph=True)
    generator = torch.Generator().manual_seed(2)

    def sample(tokens):
        q = torch.randn(2, KV_HEADS, tokens, DIM, generator=generator)
        k = torch.randn(LAYERS, 2, KV_HEADS, tokens, DIM, generator=generator)
        v = torch.randn(LAYERS, 2, KV_HEADS, tokens, DIM, generator=generator)
        return q, k, v

    attention_mask = torch.ones(2, 5, dtype=torch.long)
    attention_mask[0, :2] = 0  # row 0 left-padded
    prefill = sample(5)
    masked_step(eager, *prefill, attention_mask)
    masked_step(compiled, *prefill, attention_mask)
    for _ in range(8):
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        inputs = sample(1)
        expected = masked_step(eager, *inputs, attention_mask)
        torch.testing.assert_close(step(compiled, *inputs, attention_mask), expected, atol=1e-5,
                                   rtol=0)
    # the mask grows a column per step: one recompilation makes that dimension dynamic
    assert counter.frame_count <= 2
