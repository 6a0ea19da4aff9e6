"""One row on numba's kernels over paged caches long enough to split into several attention
chunks (`numba_kernels.CHUNK`), with sliding windows, GQA groups, q/k norms and biases: float32
logits equal the torch forward's, bfloat16 and float16 ones lie within the torch forward's own
error of a float32 forward of the same weights. (The
property tests on many short shapes, both roads: test_float32_step.py and test_half_step.py.)"""

from __future__ import annotations

import pytest
import torch
from backend_runs import forward_logits, paged_logits
from tiny_models import OwnErrors, random_model, step_families, tiny_config

from kvcache.backends import Float32Backend, HalfBackend
from kvcache.backends.cpu import numba_kernels, numba_products
from kvcache.cache import make_cache

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.kernels]  # (kernels: not in pytest --fast)

FAMILIES = step_families(window=37)
PROMPT = 2 * numba_kernels.CHUNK + 45  # three chunks, the last one partial


@pytest.mark.parametrize("family", list(FAMILIES))
def test_float32_row_over_a_long_cache_equals_the_torch_forward(family):
    assert numba_products.available()
    model = random_model(tiny_config(max_position_embeddings=1024, **FAMILIES[family]), 3)
    backend = Float32Backend(model)
    generator = torch.Generator().manual_seed(1)
    prompt, tokens = torch.randint(0, 64, (1, PROMPT), generator=generator), torch.randint(0, 64, (1, 4))
    ours = paged_logits(model, backend, prompt, tokens)
    theirs = forward_logits(model, prompt, tokens)
    for mine, reference in zip(ours, theirs):
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_half_row_over_a_long_cache_is_within_the_torch_forwards_own_error(family, dtype):
    assert numba_products.available()
    config = tiny_config(max_position_embeddings=1024, **FAMILIES[family])
    half = random_model(config, 4).to(dtype)
    exact = random_model(config, 4)
    exact.load_state_dict({name: value.float() for name, value in half.state_dict().items()})
    backend = HalfBackend(half)
    errors = OwnErrors(dtype)
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, 64, (1, PROMPT), generator=generator)
        tokens = torch.randint(0, 64, (1, 3), generator=generator)
        ours = paged_logits(half, backend, prompt, tokens)
        theirs = forward_logits(half, prompt, tokens)
        for step, (mine, reference) in enumerate(zip(ours, theirs)):
            sequence = torch.cat([prompt, tokens[:, :step]], 1)
            with torch.no_grad():
                truth = exact(sequence, past_key_values=make_cache("none", config=exact.config)).logits[:, -1]
            errors.add(mine, reference, truth)
    errors.check()
