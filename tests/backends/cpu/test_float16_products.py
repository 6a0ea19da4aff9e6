"""A float16 model's prompt on CPU runs its products and attention in float32 (rounded back to
float16): every family's prompt logits are as close to a float32 forward of the very same weights
as the plain float16 forward's (mean error within 1.25×, worst within 2×), each intercepted call
returns what the float32 call rounded to float16 returns, and calls of few rows, other dtypes
and float32 models pass through untouched."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import OwnErrors, left_padded_batch, random_model, tiny_config

from kvcache.backends.cpu.float16_products import ROWS, float32_products
from kvcache.backends.torch_step import last_logits
from kvcache.cache import make_cache

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = {
    "llama": dict(), "qwen2": dict(model_type="qwen2"), "qwen3": dict(model_type="qwen3", head_dim=16),
    "mistral, window 5": dict(model_type="mistral", sliding_window=5),
    "gemma2 (soft-caps)": dict(model_type="gemma2", sliding_window=5),
}


def _plain_logits(model, ids, mask, cache):
    out = model(ids, attention_mask=mask, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1].float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prompt_logits_are_within_the_float16_forwards_own_error_of_a_float32_forward(family):
    errors = OwnErrors(torch.float16)
    for seed, lengths in enumerate([(ROWS + 4,), (ROWS + 9, 12), (ROWS, 30, 7)]):
        half = random_model(tiny_config(**FAMILIES[family]), seed).to(torch.float16)
        exact = random_model(tiny_config(**FAMILIES[family]), seed)
        exact.load_state_dict({name: value.float() for name, value in half.state_dict().items()})
        ids, mask = left_padded_batch(lengths, seed=seed)
        ids = ids % 64  # the tiny vocabulary
        caches = [make_cache("dynamic", config=half.config, dtype=half.dtype) for _ in range(2)]
        with torch.inference_mode():
            ours = last_logits(half, ids, mask, caches[0])
            theirs = _plain_logits(half, ids, mask, caches[1])
            truth = _plain_logits(exact, ids, mask, make_cache("none", config=exact.config))
        errors.add(ours, theirs, truth)
    errors.check()


def test_an_intercepted_call_is_the_float32_call_rounded_and_a_small_one_is_left_alone():
    model = random_model(tiny_config(), 1).to(torch.float16)
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 32, generator=generator).half()
    bias = torch.randn(24, generator=generator).half()
    many = torch.randn(2, ROWS, 32, generator=generator).half()
    few = many[:1, : ROWS - 1]
    q, k, v = (torch.randn(1, 2, ROWS, 8, generator=generator).half() for _ in range(3))
    with float32_products(model, ROWS):
        linear_many, linear_few = F.linear(many, weight, bias), F.linear(few, weight, bias)
        attention_many = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attention_few = F.scaled_dot_product_attention(q[:, :, :1], k, v)
    assert linear_many.dtype == torch.float16
    assert torch.equal(linear_many, F.linear(many.float(), weight.float(), bias.float()).half())
    assert torch.equal(linear_few, F.linear(few, weight, bias))  # few rows: the float16 op itself
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).half()
    assert torch.equal(attention_many, expected)
    assert torch.equal(attention_few, F.scaled_dot_product_attention(q[:, :, :1], k, v))


def test_only_a_float16_model_on_cpu_gets_the_float32_products():
    model = random_model(tiny_config(), 3)
    x = torch.randn(ROWS, 32)
    for dtype in (torch.float32, torch.bfloat16):
        with float32_products(model.to(dtype), ROWS):
            weight = torch.randn(8, 32).to(dtype)
            out = F.linear(x.to(dtype), weight)
        assert out.dtype == dtype and torch.equal(out, F.linear(x.to(dtype), weight))
    weight = torch.randn(8, 32).half()
    with float32_products(model.to(torch.float16), ROWS - 1):  # a forward of few tokens: no mode
        out = F.linear(x.half(), weight)
    assert torch.equal(out, F.linear(x.half(), weight))
    with float32_products(model, ROWS):
        out = F.linear(x.half(), weight)
    assert out.dtype == torch.float16 and torch.equal(out, F.linear(x.half().float(), weight.float()).half())
