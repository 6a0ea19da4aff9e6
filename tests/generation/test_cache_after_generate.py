"""A cache that `generate` made or filled (under inference mode) works after it returns: crop,
reset, another forward with or without no_grad; and a call that fails leaves a supplied cache as
it was (all or nothing)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

import kvcache

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

KINDS = ["dynamic", "static", "paged", "quantized", "sliding"]


def model_for(kind: str):
    return tiny_model(layers=2, model_type="mistral", sliding_window=4) if kind == "sliding" else tiny_model()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["no_grad", "grad enabled", "inference_mode"])
def test_the_cache_generate_returns_takes_another_forward_crop_and_reset(kind, mode):
    model = model_for(kind)
    prompt = torch.tensor([[3, 9, 14, 27, 2]])
    result = kvcache.generate(model, prompt, max_new_tokens=4, cache=kind)
    cache, sequence = result.cache, result.sequences
    held = cache.get_seq_length()
    assert held == sequence.shape[1] - 1  # the last token was never run
    context = {"no_grad": torch.no_grad, "grad enabled": torch.enable_grad,
               "inference_mode": torch.inference_mode}[mode]
    with context():
        logits = model(sequence[:, -1:], past_key_values=cache).logits
        expected = model(sequence, past_key_values=kvcache.make_cache("dynamic", config=model.config)).logits
        torch.testing.assert_close(logits, expected[:, -1:], atol=1e-5, rtol=1e-5)
        if kind != "sliding":  # a ring that wrapped cannot roll back (CacheCropError, named)
            cache.crop(held)
            assert cache.get_seq_length() == held
        cache.reset()
        assert cache.get_seq_length() == 0
        model(prompt, past_key_values=cache)


@pytest.mark.parametrize("kind", ["dynamic", "static", "paged", "quantized"])
def test_a_generate_that_fails_leaves_the_supplied_cache_as_it_was(kind):
    model = model_for(kind)
    cache = kvcache.make_cache(kind, config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.tensor([[3, 9, 14]]), past_key_values=cache)
    calls = []

    def fail_on_the_third_step(module, args, output):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("a hook failed")

    handle = model.model.layers[1].register_forward_hook(fail_on_the_third_step)
    try:
        with pytest.raises(RuntimeError, match="a hook failed"):
            kvcache.generate(model, torch.tensor([[5, 6]]), cache=cache, max_new_tokens=6, backend="torch")
    finally:
        handle.remove()
    assert [layer.get_seq_length() for layer in cache.layers] == [3, 3]
    result = kvcache.generate(model, torch.tensor([[5, 6]]), cache=cache, max_new_tokens=3, backend="torch")
    fresh = kvcache.make_cache(kind, config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(torch.tensor([[3, 9, 14]]), past_key_values=fresh)
    reference = kvcache.generate(model, torch.tensor([[5, 6]]), cache=fresh, max_new_tokens=3)
    assert result.new_tokens == reference.new_tokens


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_max_new_tokens_past_the_context_is_refused_before_a_cache_is_sized_by_it(kind):
    model = tiny_model()  # a context of 256
    with pytest.raises(ValueError, match=r"make 1,000,000,003 tokens, past the model's context of 256"):
        kvcache.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=10**9, cache=kind)


def test_a_dynamic_run_past_the_context_is_warned_of():
    model = tiny_model()
    with pytest.warns(UserWarning, match="past the model's context of 256"):
        kvcache.generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=254, cache="dynamic")
