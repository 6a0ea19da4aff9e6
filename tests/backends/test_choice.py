"""Choosing the backend: a fixed rule (float32 CPU weights and plain modules: float32; bfloat16 or
float16 ones: half; else torch), never a timing; a float32 backend is built once per model and
rebuilt when the model's parameters are replaced; every choice gives the same tokens."""

from __future__ import annotations

import pytest
import torch
from tiny_models import left_padded_batch, random_model, tiny_config

from kvcache import generate, load_model
from kvcache.backends import (
    BackendError,
    Float32Backend,
    HalfBackend,
    TorchBackend,
    choose_backend,
    torch_threads,
)

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def test_auto_takes_float32_for_float32_cpu_and_torch_otherwise():
    model = random_model(tiny_config(), 0)
    assert isinstance(choose_backend(model), Float32Backend)
    assert isinstance(choose_backend(model, None), Float32Backend)
    assert isinstance(choose_backend(model, "torch"), TorchBackend)
    half = random_model(tiny_config(), 0).to(torch.bfloat16)
    assert isinstance(choose_backend(half), HalfBackend)
    with pytest.raises(BackendError, match="float32 on CPU"):
        choose_backend(half, "float32")
    with pytest.raises(BackendError, match="bfloat16 or float16 on CPU"):
        choose_backend(model, "half")
    mixed = random_model(tiny_config(), 0).to(torch.bfloat16)
    mixed.lm_head.float()
    assert isinstance(choose_backend(mixed), TorchBackend)  # one dtype for every parameter
    handle = model.model.layers[0].register_forward_hook(lambda *args: None)
    try:
        assert isinstance(choose_backend(model), TorchBackend)  # a hook must run: the module path
        with pytest.raises(BackendError, match="hooks"):
            choose_backend(model, "float32")
    finally:
        handle.remove()
    mine = TorchBackend(model)
    assert choose_backend(model, mine) is mine
    with pytest.raises(BackendError, match="backend must be one of"):
        choose_backend(model, "mkl")


def test_a_float32_backend_is_built_once_per_model_until_its_parameters_are_replaced():
    model = random_model(tiny_config(), 1)
    first = choose_backend(model)
    assert choose_backend(model) is first  # no second packing
    assert choose_backend(random_model(tiny_config(), 1)) is not first  # another model
    attention = model.model.layers[1].self_attn
    attention.v_proj.weight = torch.nn.Parameter(torch.zeros_like(attention.v_proj.weight))
    rebuilt = choose_backend(model)
    assert rebuilt is not first and rebuilt.matches(model)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(2))
    tokens = {
        name: generate(model, ids, max_new_tokens=6, eos_token_id=(), backend=name).new_tokens
        for name in ("auto", "torch")
    }
    assert tokens["auto"] == tokens["torch"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3"])
def test_every_backend_gives_the_same_tokens_on_a_checkpoint(checkpoints, arch):
    model = load_model(checkpoints[arch][0])
    ids, mask = left_padded_batch((8, 5), seed=21)
    results = {}
    for name in ("auto", "float32", "torch"):  # the float32 ones (the half step: test_half_step)
        result = generate(model, ids, mask, max_new_tokens=8, eos_token_id=(), backend=name)
        results[name] = result.sequences
        assert result.backend == ("torch" if name == "torch" else "float32")
    assert torch.equal(results["float32"], results["torch"])
    assert torch.equal(results["auto"], results["torch"])


def test_threads_are_restored_after_a_float32_decode():
    model = random_model(tiny_config(), 3)
    before = torch.get_num_threads()
    seen = []
    generate(
        model,
        torch.tensor([[5, 6]]),
        max_new_tokens=3,
        streamer=lambda _: seen.append(torch.get_num_threads()),
    )
    assert torch.get_num_threads() == before and seen == [before] * 3


def test_torch_threads_sets_and_restores_even_on_error():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with torch_threads(1):
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), torch_threads(1):
            raise RuntimeError("inside")
        assert torch.get_num_threads() == 2
        with torch_threads(None):
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
