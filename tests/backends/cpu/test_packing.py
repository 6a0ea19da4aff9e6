"""Packing the weights for the float32 step is a layout only: the model keeps its Parameters, names,
shapes and values, reads the packed memory itself (one copy of every weight), and decodes the
same tokens; a small model's weights sit in one block on 2 MB pages that lives as long as any
weight viewing it."""

from __future__ import annotations

import gc

import pytest
import torch
from backend_runs import paged_logits
from tiny_models import random_model, tiny_config

from kvcache import generate
from kvcache.backends import Float32Backend, TorchBackend
from kvcache.backends.cpu import huge_pages, packing
from kvcache.backends.cpu.packing import pack_weights

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def _storages(model) -> dict[int, int]:
    """data pointer -> bytes of every storage the model's parameters use."""
    storages = {}
    for parameter in model.parameters():
        storage = parameter.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return storages


@pytest.mark.parametrize(
    "overrides", [{}, {"attention_bias": True, "tie_word_embeddings": True}], ids=["plain", "biases+tied"]
)
def test_values_names_shapes_and_tokens_stay_and_the_model_reads_the_packed_memory(overrides):
    model = random_model(tiny_config(num_hidden_layers=3, **overrides), 0)
    before = {name: (id(p), p.shape, p.detach().clone()) for name, p in model.named_parameters()}
    names = sorted(model.state_dict())
    prompt = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(3))
    tokens = generate(model, prompt, max_new_tokens=12, eos_token_id=(), backend="torch").sequences

    backend = Float32Backend(model)

    for name, parameter in model.named_parameters():
        identity, shape, values = before[name]
        assert id(parameter) == identity and parameter.shape == shape, name
        assert torch.equal(parameter, values), name
    assert sorted(model.state_dict()) == names
    layer = backend.weights.layers[0]
    attention = model.model.layers[0].self_attn
    fused = range(layer.qkv.ctypes.data, layer.qkv.ctypes.data + layer.qkv.nbytes)
    for projection in (attention.q_proj, attention.k_proj, attention.v_proj):
        assert projection.weight.data_ptr() in fused  # slices of the one matrix the step reads
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if model.config.qkv_bias:
        assert layer.qkv_bias is not None
        assert attention.q_proj.bias.data_ptr() == layer.qkv_bias.ctypes.data
    assert backend.matches(model)
    for name in ("float32", "torch"):
        again = generate(model, prompt, max_new_tokens=12, eos_token_id=(), backend=name).sequences
        assert torch.equal(again, tokens), name


def test_every_matrix_is_row_major_for_numbas_products():
    model = random_model(tiny_config(), 1)  # hidden 32: q/k/v (64 rows), gate/up (128)
    layer = pack_weights(model).layers[0]  # numba's products: each output one contiguous row
    assert layer.gate_up.T.flags.c_contiguous and layer.gate_up.shape == (32, 128)  # read as (in, out)
    assert layer.down.T.flags.c_contiguous
    assert model.model.layers[0].mlp.gate_proj.weight.is_contiguous()


@pytest.mark.skipif(not huge_pages.huge_pages_available(), reason="no transparent huge pages on this OS")
def test_a_small_model_moves_into_one_aligned_block_that_lives_as_long_as_a_weight():
    model = random_model(tiny_config(), 2)
    assert Float32Backend(model).weights.on_huge_pages
    storages = _storages(model)
    starts = sorted(storages)
    assert starts[0] % huge_pages.HUGE_PAGE == 0  # the block starts on a 2 MB boundary
    span = starts[-1] + storages[starts[-1]] - starts[0]
    assert span < sum(storages.values()) + huge_pages.ALIGN * len(storages) * 4  # one block
    kept = model.model.layers[1].mlp.down_proj.weight
    expected = kept.detach().clone()
    del model
    gc.collect()
    churn = [torch.randn(256, 256) for _ in range(64)]  # reuse whatever memory was freed
    assert torch.equal(kept, expected)
    del churn


def test_a_large_model_keeps_its_layout_where_it_fits(monkeypatch):
    """Past MOVE_LIMIT nothing moves onto huge pages: weights already laid out as the step reads
    them (o_proj, down_proj, norms, the embedding) are viewed in place, not copied."""
    monkeypatch.setattr(packing, "MOVE_LIMIT", 1024)
    model = random_model(tiny_config(), 3)
    kept = {
        name: p.data_ptr()
        for name, p in model.named_parameters()
        if name.endswith(("o_proj.weight", "down_proj.weight", "norm.weight", "embed_tokens.weight"))
    }
    backend = Float32Backend(model)
    assert not backend.weights.on_huge_pages
    now = dict((name, p.data_ptr()) for name, p in model.named_parameters())
    assert all(now[name] == pointer for name, pointer in kept.items())
    assert backend.weights.layers[0].down.ctypes.data == kept["model.layers.0.mlp.down_proj.weight"]


def test_matches_tells_an_in_place_write_from_a_replaced_or_moved_parameter():
    model = random_model(tiny_config(), 4)
    backend = Float32Backend(model)
    with torch.no_grad():
        model.load_state_dict({name: t * 1.5 for name, t in model.state_dict().items()})  # in place
    assert backend.matches(model)  # the same memory: the step reads the new values
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(5))
    logits = {step.name: paged_logits(model, step, ids[:, :-1], ids[:, -1:])[-1]
              for step in (backend, TorchBackend(model))}
    torch.testing.assert_close(logits["float32"], logits["torch"], atol=1e-4, rtol=1e-4)
    down = model.model.layers[0].mlp.down_proj
    down.weight.data = down.weight.data * 2  # the same Parameter, new memory
    assert not backend.matches(model)
    rebuilt = Float32Backend(model)
    assert rebuilt.matches(model)
    model.lm_head = torch.nn.Linear(32, 64, bias=False)  # a new module, a new Parameter
    assert not rebuilt.matches(model)


def test_the_model_still_trains_after_generate_packed_it():
    """generate builds the backend inside its inference mode; the packed parameters must still
    be ordinary tensors that take gradients."""
    model = random_model(tiny_config(), 6)
    generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=3)  # packs the weights
    assert not any(parameter.is_inference() for parameter in model.parameters())
    model.train()
    loss = model(torch.tensor([[1, 2, 3, 4]]), use_cache=False).logits.sum()
    loss.backward()
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
