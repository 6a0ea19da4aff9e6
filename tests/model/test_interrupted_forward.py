"""An exception between layers (Ctrl-C, a failing hook) leaves no cache with layers at different
lengths that the next forward accepts: the forward is undone, so the next one answers as if the
failed one never ran, for every cache kind and for a paged cache's steps on a backend."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

import kvcache
from kvcache.cache import CacheError, CacheStateError

KINDS = ["dynamic", "static", "sliding", "quantized", "paged", "none"]


def make(kind: str, model):
    options = {"residual_length": 2, "group_size": 8} if kind == "quantized" else {}
    window = 4 if kind == "sliding" else None
    return kvcache.make_cache(kind, config=model.config, max_cache_len=32, window=window, dtype=model.dtype,
                              **options)


class Interrupt(KeyboardInterrupt):
    pass


def interrupting(model, layer: int):
    def hook(module, args, output):
        raise Interrupt()

    return model.model.layers[layer].register_forward_hook(hook)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("new_tokens", [1, 3])
def test_a_forward_interrupted_between_layers_is_undone_or_refused(kind, new_tokens):
    windowed = dict(model_type="mistral", sliding_window=4) if kind == "sliding" else {}
    model = tiny_model(layers=3, **windowed)
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(0))
    prompt, nxt = ids[:, :6], ids[:, 6 : 6 + new_tokens]
    with torch.no_grad():
        reference_cache = make(kind, model)
        model(prompt, past_key_values=reference_cache)
        expected = model(nxt, past_key_values=reference_cache).logits
        cache = make(kind, model)
        model(prompt, past_key_values=cache)
        handle = interrupting(model, 1)
        with pytest.raises(Interrupt):
            model(nxt, past_key_values=cache)
        handle.remove()
        if kind == "sliding":  # the ring overwrote its oldest rows: no going back, so it is refused
            with pytest.raises(CacheStateError, match=r"interrupted between layers.*reset\(\)"):
                model(nxt, past_key_values=cache)
            cache.reset()
            model(prompt, past_key_values=cache)
        lengths = {layer.get_seq_length() for layer in cache.layers}
        assert len(lengths) <= 1, f"layers left at lengths {lengths}"
        got = model(nxt, past_key_values=cache).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_a_cache_whose_layers_disagree_is_refused_until_crop():
    model = tiny_model(layers=2)
    cache = kvcache.DynamicCache(config=model.config)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), past_key_values=cache)
    cache.layers[1].update(torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))  # layer 1 alone moves on
    with pytest.raises(CacheError, match=r"layers hold different lengths \[3, 4\].*crop\(3\)"):
        model(torch.tensor([[4]]), past_key_values=cache)
    cache.crop(3)
    model(torch.tensor([[4]]), past_key_values=cache)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "half"])
def test_a_paged_step_interrupted_before_its_commit_is_undone(dtype):
    """generate on a paged cache runs each forward as reserve -> the backend's step -> commit:
    interrupted after the kernels wrote every layer's rows, before the cache records them, the
    call leaves the rows as they were, and the next call answers as if it never ran."""
    model = tiny_model(layers=3).to(dtype)
    prompt, turn = torch.tensor([[5, 9, 2, 7]]), torch.tensor([[11, 3]])

    def first_turn():
        cache = make("paged", model)
        kvcache.generate(model, prompt, cache=cache, max_new_tokens=1)  # keeps the prompt's rows
        return cache

    expected = kvcache.generate(model, turn, cache=first_turn(), max_new_tokens=4, eos_token_id=())
    cache = first_turn()
    held = cache.row_lengths

    def interrupted(*args, **kwargs):
        raise Interrupt()

    cache.commit = interrupted
    with pytest.raises(Interrupt):
        kvcache.generate(model, turn, cache=cache, max_new_tokens=4, eos_token_id=())
    del cache.commit  # the class's own method again
    assert cache.row_lengths == held
    again = kvcache.generate(model, turn, cache=cache, max_new_tokens=4, eos_token_id=())
    assert again.backend == expected.backend != "torch"
    assert again.new_tokens == expected.new_tokens
