"""A QuantizedCache in the model and the generate loop: the model never branches on the kind."""

from __future__ import annotations

import pytest
import torch
from tiny_models import llama_checkpoint

from kvcache.backends import torch_threads
from kvcache.cache import QuantizedCache, make_cache
from kvcache.generation import generate
from kvcache.model import load_model

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = llama_checkpoint(
        tmp_path_factory.mktemp("tiny_llama"), seed=7, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
        max_position_embeddings=512,
    )
    with torch_threads(1):  # tiny shapes: one thread is faster on a shared machine
        yield load_model(folder)


def prompt(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bits", [8, 4, "fp8"])
def test_while_nothing_is_flushed_logits_equal_the_dynamic_cache(model, bits):
    ids = prompt(20)
    quantized = make_cache("quantized", config=model.config, bits=bits, group_size=16, residual_length=64)
    dynamic = make_cache("dynamic", config=model.config)
    with torch.no_grad():
        for start, end in [(0, 12), (12, 13), (13, 20)]:
            got = model(ids[:, start:end], past_key_values=quantized).logits
            want = model(ids[:, start:end], past_key_values=dynamic).logits
            assert torch.equal(got, want)


@pytest.mark.parametrize("bits,bound", [(8, 0.2), (4, 2.0), ("fp8", 1.0)])
def test_quantized_history_moves_logits_a_little(model, bits, bound):
    ids = prompt(40, seed=1)
    cache = make_cache("quantized", config=model.config, bits=bits, group_size=16, residual_length=0)
    with torch.no_grad():
        got = model(ids[:, :32], past_key_values=cache).logits
        got = torch.cat([got, model(ids[:, 32:], past_key_values=cache).logits], dim=1)
        want = model(ids, use_cache=False).logits
    assert cache.layers[0].quantized_tokens == 32
    difference = float((got - want).abs().max())
    assert 0 < difference < bound


def test_generate_with_a_quantized_cache_object_and_a_left_padded_batch(model):
    ids = prompt(9, seed=2).repeat(2, 1)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    cache = QuantizedCache(config=model.config, bits=8, group_size=8, residual_length=4)
    result = generate(model, ids, mask, max_new_tokens=12, cache=cache, eos_token_id=())
    assert result.cache is cache and cache.get_seq_length() == 9 + 11
    assert cache.layers[0].quantized_tokens == 16
    # groups never span batch rows, so the unpadded row is what it would be alone
    alone = generate(
        model, ids[:1], max_new_tokens=12, eos_token_id=(),
        cache=QuantizedCache(config=model.config, bits=8, group_size=8, residual_length=4),
    )
    assert result.new_tokens[0] == alone.new_tokens[0]


def test_bfloat16_model_gets_bfloat16_keys_and_bfloat16_scales(model):
    cache = QuantizedCache(config=model.config, bits=4, group_size=8, residual_length=0)
    k = torch.randn(1, 2, 16, 16, dtype=torch.bfloat16)
    keys, values = cache.update(k, k, 0)
    assert keys.dtype == values.dtype == torch.bfloat16
    store = cache.layers[0]._key_store
    assert store is not None and store.rows().scale.dtype == torch.bfloat16
