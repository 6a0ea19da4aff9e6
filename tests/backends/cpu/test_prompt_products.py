"""A prompt's forward on a backend's laid-out weights (`prompt_products`) against the oracles: on
every family, batch and left padding, float32 prompt logits and cached keys equal the plain
forward's (float tolerance) and bfloat16 ones are as close to a float32 forward of the same
weights as the plain bfloat16 forward's; every projection of the forward is answered by the copy;
a call on another input, another bias or with autograd runs as it is; generate's tokens are the
torch backend's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import OwnErrors, left_padded_batch, random_model, tiny_config

from kvcache import generate
from kvcache.backends import HalfBackend, NumpyBackend, TorchBackend
from kvcache.backends.torch_step import last_logits
from kvcache.cache import make_cache

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)

FAMILIES = {
    "llama": dict(), "llama, MHA, biases": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "qwen2 (q/k/v bias)": dict(model_type="qwen2"),
    "qwen3 (q/k norms)": dict(model_type="qwen3", head_dim=16),
    "mistral, window 5": dict(model_type="mistral", sliding_window=5),
}  # (the families the numpy and half steps run)
BATCHES = [(7,), (20, 4), (6, 31, 3)]


def _prompt(model, backend, ids, mask):
    """(logits (B, vocab), the cache's keys of layer 0, projections the copy answered)."""
    cache = make_cache("dynamic", config=model.config, dtype=model.dtype)
    with torch.inference_mode():
        if backend is None:
            logits, served = last_logits(model, ids, mask, cache), 0
        else:
            with backend.prompt_products() as mode:
                logits = last_logits(model, ids, mask, cache)
            served = mode.served
    return logits, cache.layers[0].keys, served


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_prompts_on_the_copy_equal_the_plain_forward(family):
    for seed, lengths in enumerate(BATCHES):
        model = random_model(tiny_config(**FAMILIES[family]), seed)
        ids, mask = left_padded_batch(lengths, seed=seed)
        ids = ids % 64  # the tiny vocabulary
        ours, our_keys, served = _prompt(model, NumpyBackend(model), ids, mask)
        theirs, their_keys, _ = _prompt(model, None, ids, mask)
        assert served == 7 * model.config.num_hidden_layers + 1  # every projection and lm_head
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(our_keys, their_keys, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_bfloat16_prompts_on_the_copy_are_within_the_plain_forwards_error_of_a_float32_one(family):
    """In units of bfloat16's eps times the largest logit: the mean error over the batches within
    1.25× the plain bfloat16 forward's, the worst within 2×."""
    errors = OwnErrors(torch.bfloat16)
    for seed, lengths in enumerate(BATCHES):
        half = random_model(tiny_config(**FAMILIES[family]), seed).to(torch.bfloat16)
        exact = random_model(tiny_config(**FAMILIES[family]), seed)
        exact.load_state_dict({name: value.float() for name, value in half.state_dict().items()})
        ids, mask = left_padded_batch(lengths, seed=seed)
        ids = ids % 64
        ours, _, served = _prompt(half, HalfBackend(half), ids, mask)
        theirs, _, _ = _prompt(half, None, ids, mask)
        truth, _, _ = _prompt(exact, None, ids, mask)
        assert served == 7 * half.config.num_hidden_layers + 1
        errors.add(ours, theirs, truth)
    errors.check()


def test_a_member_on_another_input_or_with_another_bias_or_autograd_is_computed_as_it_is():
    model = random_model(tiny_config(attention_bias=True), 4)
    backend = NumpyBackend(model)
    attention = model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(1)
    x, other = (torch.randn(2, 5, model.config.hidden_size, generator=generator) for _ in range(2))
    q, k, v = attention.q_proj, attention.k_proj, attention.v_proj
    with torch.no_grad(), backend.prompt_products() as mode:
        q_out = q(x)  # computes the fused q/k/v product of x
        k_other = k(other)  # another input: not x's k columns
        v_out = v(x)  # x's v columns (k's were taken by `other`'s product)
        k_bias = F.linear(x, k.weight, torch.zeros_like(k.bias))  # another bias: as it is
    with torch.no_grad():
        for got, expected in ((q_out, q(x)), (k_other, k(other)), (v_out, v(x)),
                              (k_bias, F.linear(x, k.weight, torch.zeros_like(k.bias)))):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert mode.served == 3  # q, k on `other`, v; the call with another bias ran on its own
    with backend.prompt_products() as mode:  # autograd on: torch's own product, which it can trace
        out = q(x)
    assert mode.served == 0 and out.requires_grad


def test_generate_with_the_copy_gives_the_torch_backends_tokens():
    """float32 (bfloat16's half step rounds otherwise than the torch forward by design: its
    tokens are compared with transformers' in tests/backends/test_half_step.py)."""
    model = random_model(tiny_config(), 6)
    ids, mask = left_padded_batch((24, 9), seed=3)
    ids = ids % 64
    ours = generate(model, ids, mask, max_new_tokens=8, backend="numpy", prefill_chunk_size=10)
    theirs = generate(model, ids, mask, max_new_tokens=8, backend=TorchBackend(model))
    assert torch.equal(ours.sequences, theirs.sequences)
