"""Moving the weights onto huge pages is a layout only: same Parameters, names, shapes, strides,
values and decoded tokens; the memory is one block that lives as long as any weight viewing it."""

from __future__ import annotations

import gc

import pytest
import torch
from tiny_models import tiny_model

from kvcache import generate
from kvcache.model import weight_arena
from kvcache.model.kernels import fuse_projections, store_tall_weights_transposed
from kvcache.model.weight_arena import HUGE_PAGE, huge_pages_available, move_weights_to_huge_pages


def _prepared(seed: int = 0):
    """A tiny model laid out as load_model(matvec="numpy") lays it out, before the move."""
    model = tiny_model(seed, layers=3)
    fuse_projections(model)
    model.matvec_backend = "numpy"
    store_tall_weights_transposed(model)
    return model


def _weights(model) -> list[torch.Tensor]:
    fused = [
        tensor
        for layer in model.model.layers
        for tensor in (layer.self_attn.fused_qkv.weight, layer.mlp.fused_gate_up.weight)
    ]
    return [*model.parameters(), *fused]


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this OS")
def test_weights_move_into_one_aligned_block_and_keep_everything_else():
    model = _prepared()
    before = {name: (id(p), p.shape, p.stride(), p.detach().clone()) for name, p in model.named_parameters()}
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    tokens_before = generate(model, prompt, max_new_tokens=12, eos_token_id=()).sequences

    assert move_weights_to_huge_pages(model)

    pointers = sorted(tensor.untyped_storage().data_ptr() for tensor in _weights(model))
    assert pointers[0] % HUGE_PAGE == 0  # the block starts on a 2 MB boundary
    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage() for tensor in _weights(model)}
    total = sum(storage.nbytes() for storage in storages.values())
    assert pointers[-1] - pointers[0] < total + 64 * len(pointers)  # one block, storages back to back
    for name, parameter in model.named_parameters():
        identity, shape, stride, values = before[name]
        assert id(parameter) == identity and parameter.shape == shape and parameter.stride() == stride, name
        assert torch.equal(parameter, values), name
    assert model.lm_head.weight is model.model.embed_tokens.weight or not model.config.tie_word_embeddings
    for layer in model.model.layers:
        assert layer.self_attn.fused_qkv.is_intact() and layer.mlp.fused_gate_up.is_intact()
    assert torch.equal(generate(model, prompt, max_new_tokens=12, eos_token_id=()).sequences, tokens_before)
    model.matvec_backend = "torch"
    assert torch.equal(generate(model, prompt, max_new_tokens=12, eos_token_id=()).sequences, tokens_before)


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this OS")
def test_the_block_lives_as_long_as_a_weight_viewing_it():
    model = _prepared(seed=1)
    assert move_weights_to_huge_pages(model)
    kept = model.model.layers[1].mlp.down_proj.weight
    expected = kept.detach().clone()
    del model
    gc.collect()
    churn = [torch.randn(256, 256) for _ in range(64)]  # reuse whatever memory was freed
    assert torch.equal(kept, expected)
    del churn


def test_nothing_moves_without_huge_pages(monkeypatch):
    model = _prepared()
    pointers = [tensor.data_ptr() for tensor in _weights(model)]
    monkeypatch.setattr(weight_arena, "huge_pages_available", lambda: False)
    assert not move_weights_to_huge_pages(model)
    assert [tensor.data_ptr() for tensor in _weights(model)] == pointers


def test_nothing_moves_when_a_weight_is_not_on_cpu():
    model = _prepared()
    model.model.norm.weight = torch.nn.Parameter(torch.empty(model.config.hidden_size, device="meta"))
    pointers = [tensor.data_ptr() for tensor in _weights(model) if tensor.device.type == "cpu"]
    assert not move_weights_to_huge_pages(model)
    assert [tensor.data_ptr() for tensor in _weights(model) if tensor.device.type == "cpu"] == pointers
