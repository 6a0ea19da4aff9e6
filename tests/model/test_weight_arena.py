"""Moving the weights onto huge pages is a layout only: same Parameters, names, shapes, strides,
values and decoded tokens; the memory is one block that lives as long as any weight viewing it."""

from __future__ import annotations

import gc

import pytest
import torch
from tiny_models import randomize_weights

from kvcache import generate
from kvcache.model import LlamaForCausalLM, ModelConfig, weight_arena
from kvcache.model.kernels import fuse_projections, store_tall_weights_transposed
from kvcache.model.weight_arena import HUGE_PAGE, huge_pages_available, move_weights_to_huge_pages


def _prepared(seed: int = 0, **overrides):
    """A tiny model laid out as load_model(matvec="numpy") lays it out, before the move;
    overrides change its config (biases, tied embeddings)."""
    config = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, **overrides,
    ))
    torch.manual_seed(seed)
    model = randomize_weights(LlamaForCausalLM(config).eval())
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
@pytest.mark.parametrize(
    "overrides",
    [{}, {"attention_bias": True, "tie_word_embeddings": True}],
    ids=["plain", "biases+tied"],
)
def test_weights_move_into_one_aligned_block_and_keep_everything_else(overrides):
    model = _prepared(**overrides)
    storages_before = len({tensor.untyped_storage().data_ptr() for tensor in _weights(model)})
    before = {name: (id(p), p.shape, p.stride(), p.detach().clone()) for name, p in model.named_parameters()}
    prompt = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(3))
    tokens_before = generate(model, prompt, max_new_tokens=12, eos_token_id=()).sequences

    assert move_weights_to_huge_pages(model)

    storages = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage() for tensor in _weights(model)}
    assert len(storages) == storages_before  # tensors that shared a storage still do, no others
    starts = sorted(storages)
    assert starts[0] % HUGE_PAGE == 0  # the block starts on a 2 MB boundary
    total = sum(storage.nbytes() for storage in storages.values())
    assert starts[-1] + storages[starts[-1]].nbytes() - starts[0] < total + 64 * len(starts)  # one block
    for first, second in zip(starts, starts[1:]):
        assert first + storages[first].nbytes() <= second  # back to back, never overlapping
    for name, parameter in model.named_parameters():
        identity, shape, stride, values = before[name]
        assert id(parameter) == identity and parameter.shape == shape and parameter.stride() == stride, name
        assert torch.equal(parameter, values), name
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if model.config.qkv_bias:
        attention = model.model.layers[0].self_attn
        bias_storage = attention.fused_qkv.bias.untyped_storage().data_ptr()
        assert attention.q_proj.bias.untyped_storage().data_ptr() == bias_storage
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


@pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this OS")
def test_a_replaced_projection_stays_apart_from_its_fused_weight():
    """A fused weight that no longer backs its projections stays so after the move."""
    model = _prepared(seed=2)
    mlp = model.model.layers[1].mlp
    mlp.up_proj.weight = torch.nn.Parameter(mlp.up_proj.weight.detach().clone())
    assert not mlp.fused_gate_up.is_intact()
    assert move_weights_to_huge_pages(model)
    assert not mlp.fused_gate_up.is_intact()
    assert model.model.layers[0].mlp.fused_gate_up.is_intact()


def test_nothing_moves_past_the_size_limit():
    model = _prepared()
    pointers = [tensor.data_ptr() for tensor in _weights(model)]
    weight_bytes = sum(parameter.nbytes for parameter in model.parameters())
    assert not move_weights_to_huge_pages(model, limit=weight_bytes // 2)
    assert [tensor.data_ptr() for tensor in _weights(model)] == pointers


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
