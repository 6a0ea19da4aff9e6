"""When the numpy decode step and the fused projections may stand in for calling the modules,
and when `generate` may call the step directly: never where a hook, a replaced forward, a
module of another class or a change to the model would make the result differ."""

from __future__ import annotations

import copy

import pytest
import torch
from test_numpy_decode import _both_paths, _small_config, random_model
from torch import nn

from kvcache import generate
from kvcache.generation import loop
from kvcache.generation.loop import build_cache
from kvcache.model.config import SLIDING_ATTENTION
from kvcache.model.llama import MLP

pytest.importorskip("numpy")


def test_generate_calls_the_numpy_step_directly_unless_padded(monkeypatch):
    model = random_model(_small_config(), 20, transposed=True)
    model.matvec_backend = "numpy"
    calls = []
    original = loop._forward_last
    monkeypatch.setattr(loop, "_forward_last", lambda *args: calls.append(1) or original(*args))
    prompt = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(9))
    generate(model, prompt, max_new_tokens=5, eos_token_id=())
    assert len(calls) == 1  # the prefill only: every decode step went to decode_logits
    calls.clear()
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0  # left padding: masks per step, through the model's forward
    generate(model, prompt, mask, max_new_tokens=5, eos_token_id=())
    assert len(calls) == 5


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "paged", "quantized"])
def test_decode_logits_equals_the_model_call_on_a_filled_cache(kind):
    """One direct step and one `model(...)` step from copies of the same filled cache: the
    same logits and the same cache contents afterwards."""
    window = dict(sliding_window=4, layer_types=(SLIDING_ATTENTION,) * 2) if kind == "sliding" else {}
    model = random_model(_small_config(**window), 21)
    model.matvec_backend = "numpy"
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(10))
    with torch.inference_mode():
        cache = build_cache(model, kind, 2, 16)
        model(ids[:, :6], past_key_values=cache)
        mine, theirs = copy.deepcopy(cache), copy.deepcopy(cache)
        direct = model.decode_logits(ids[:, 6:], mine)
        called = model(ids[:, 6:], past_key_values=theirs).logits[:, -1]
    assert direct is not None
    torch.testing.assert_close(direct, called, atol=1e-6, rtol=1e-6)
    assert mine.get_seq_length() == theirs.get_seq_length() == 7


def test_generate_calls_a_model_hooked_after_an_earlier_call():
    """A hook on the model itself, registered between two generate calls (the first one left
    the step's check cached as passed), runs at every decode step of the second."""
    model = random_model(_small_config(), 22, transposed=True)
    model.matvec_backend = "numpy"
    prompt = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(11))
    generate(model, prompt, max_new_tokens=4, eos_token_id=())

    def force_token_3(module, args, output):
        output.logits[..., 3] = 1e9
        return output

    handle = model.register_forward_hook(force_token_3)
    try:
        result = generate(model, prompt, max_new_tokens=4, eos_token_id=())
    finally:
        handle.remove()
    assert result.new_tokens[0] == [3, 3, 3, 3]


@pytest.mark.parametrize("rows", [1, 12])
def test_fused_projections_call_hooked_linears(rows):
    """A hook on q_proj or up_proj is called on the torch path whatever the number of rows:
    the fused product stands in for the linears only while they are plain."""
    model = random_model(_small_config(), 23)
    model.matvec_backend = "torch"
    reference = copy.deepcopy(model)
    for layer in reference.model.layers:  # no fused weights: every projection is a call
        layer.self_attn.fused_qkv = layer.mlp.fused_gate_up = None
    ids = torch.randint(0, 40, (1, rows + 1), generator=torch.Generator().manual_seed(12))
    for net in (model, reference):
        layer = net.model.layers[0]
        layer.self_attn.q_proj.register_forward_hook(lambda module, args, out: out * 0)
        layer.mlp.up_proj.register_forward_hook(lambda module, args, out: out * 2)
    with torch.inference_mode():
        ours = model(ids).logits
        expected = reference(ids).logits
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    with torch.inference_mode():
        unhooked = random_model(_small_config(), 23)(ids).logits
    assert not torch.allclose(ours, unhooked, atol=1e-3)


def test_numpy_step_sees_an_added_bias_and_a_class_changed_in_place():
    model = random_model(_small_config(), 24)
    ids = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(13))
    before = _both_paths(model, ids)["numpy"]  # builds the step's views
    o_proj = model.model.layers[1].self_attn.o_proj
    assert o_proj.bias is None
    o_proj.bias = nn.Parameter(torch.randn(16, generator=torch.Generator().manual_seed(14)))
    added = _both_paths(model, ids)
    torch.testing.assert_close(added["numpy"], added["torch"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(added["numpy"], before)

    class Halved(MLP):
        def forward(self, x):
            return super().forward(x) / 2

    model.model.layers[0].mlp.__class__ = Halved
    changed = _both_paths(model, ids)
    torch.testing.assert_close(changed["numpy"], changed["torch"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(changed["numpy"], added["numpy"])
