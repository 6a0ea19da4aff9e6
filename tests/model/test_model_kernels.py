"""Fused projections and the matrix-vector backends change speed, never the answer."""

from __future__ import annotations

import pytest
import torch
from model_helpers import left_padded_batch
from torch import nn

from kvcache import generate, load_model
from kvcache.model.kernels import BACKENDS, choose_decode_path, numpy_available


def test_fused_weights_are_views_with_the_checkpoint_names(llama_dir):
    model = load_model(llama_dir)
    attn = model.model.layers[0].self_attn
    fused = attn.fused_qkv
    assert fused is not None and fused.is_intact()
    base = fused.weight.untyped_storage().data_ptr()
    assert all(p.weight.untyped_storage().data_ptr() == base for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert "model.layers.0.self_attn.q_proj.weight" in model.state_dict()
    assert not any("fused" in name for name in model.state_dict())


def test_replacing_a_weight_falls_back_to_the_separate_projections(llama_dir):
    model = load_model(llama_dir)
    ids = torch.randint(3, 259, (1, 6))
    with torch.no_grad():
        before = model(ids).logits
        attn = model.model.layers[1].self_attn
        attn.k_proj.weight = nn.Parameter(torch.zeros_like(attn.k_proj.weight))
        assert not attn.fused_qkv.is_intact()
        after = model(ids).logits
        attn.fused_qkv = None  # the plain path, for reference
        plain = model(ids).logits
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, plain, atol=1e-6, rtol=0)


@pytest.mark.skipif(not numpy_available(), reason="numpy not installed")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_numpy_backend_gives_the_same_tokens(checkpoints, arch):
    ids, mask = left_padded_batch((8, 5), seed=21)
    results = {}
    for backend in BACKENDS:
        model = load_model(checkpoints[arch][0], matvec=backend)
        assert model.matvec_backend == backend
        with torch.no_grad():
            results[backend] = (
                model(ids, attention_mask=mask).logits,
                generate(model, ids, mask, max_new_tokens=8, eos_token_id=()).sequences,
            )
    torch.testing.assert_close(results["numpy"][0], results["torch"][0], atol=1e-4, rtol=0)
    assert torch.equal(results["numpy"][1], results["torch"][1])


def test_auto_times_decode_steps_and_keeps_the_fastest(llama_dir):
    model = load_model(llama_dir)
    threads = torch.get_num_threads()
    timings = choose_decode_path(model, repeats=2)
    assert ("torch", 1) in timings and all(backend in BACKENDS for backend, _ in timings)
    assert (model.matvec_backend, model.decode_threads) == min(timings, key=timings.get)
    assert torch.get_num_threads() == threads  # restored
    assert load_model(llama_dir, dtype=torch.bfloat16, matvec="auto").matvec_backend == "torch"
    with pytest.raises(ValueError, match="matvec must be one of"):
        load_model(llama_dir, matvec="mkl")


def test_decode_threads_are_restored_after_generate(llama_dir):
    model = load_model(llama_dir)
    model.decode_threads = 1
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
    from kvcache.model.kernels import torch_threads

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
