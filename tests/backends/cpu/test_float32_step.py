"""The float32 backend's steps compute what the model's forward computes, on any shape it takes.

One random model, B rows (B in 1, 3, 8) with prompts of their own lengths, run on a paged cache
by the float32 backend and by the torch backend (the model's forward over the same blocks), the
prompt in chunks of any size, then decode steps: logits agree to float32 rounding, and so do
the keys and values each cache holds, for any block size, grouped-query attention, biases, tied
embeddings, q/k norms and sliding-window layers; and each row's last logits equal a solo forward
of that row's whole sequence without a cache (the naive reference).
"""

from __future__ import annotations

import pytest
import torch
from backend_runs import paged_logits
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import random_model, tiny_config

from kvcache.backends import BackendError, Float32Backend, TorchBackend
from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcache.model import ConfigError, ModelConfig, RopeScaling

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def _config(draw) -> ModelConfig:
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    layers = draw(st.integers(1, 3))
    window = draw(st.none() | st.integers(2, 6))
    bias = draw(st.sampled_from(["none", "qkv", "all"]))
    return ModelConfig(
        model_type="llama" if window is None else "mistral",
        vocab_size=draw(st.integers(8, 40)),
        hidden_size=draw(st.sampled_from([8, 16, 24])),
        intermediate_size=draw(st.integers(4, 40)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=draw(st.sampled_from([4, 8, 16])),
        max_position_embeddings=64,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
        tie_word_embeddings=draw(st.booleans()),
        qkv_bias=bias != "none",
        o_bias=bias == "all",
        mlp_bias=bias == "all",
        qk_norm=draw(st.sampled_from([None, "head"])),  # qwen3's per-head q/k norms, on any shape
        sliding_window=window,
        layer_types=tuple(
            draw(st.sampled_from([FULL_ATTENTION, SLIDING_ATTENTION])) if window else FULL_ATTENTION
            for _ in range(layers)
        ),
    )


@st.composite
def cases(draw):
    batch = draw(st.sampled_from([1, 3, 8]))
    return dict(
        config=_config(draw),
        lengths=[draw(st.integers(1, 7)) for _ in range(batch)],
        steps=draw(st.integers(1, 6)),
        seed=draw(st.integers(0, 2**16)),
        block_size=draw(st.sampled_from([1, 3, 16])),
        chunk=draw(st.none() | st.integers(1, 4)),
    )


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_float32_steps_equal_the_torch_forward_and_the_solo_no_cache_run(case):
    config, lengths, steps = case["config"], case["lengths"], case["steps"]
    model = random_model(config, case["seed"])
    generator = torch.Generator().manual_seed(case["seed"])
    rows = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    tokens = torch.randint(0, config.vocab_size, (len(rows), steps), generator=generator)
    caches: list = []
    ours, theirs = (
        paged_logits(model, backend, rows, tokens, case["block_size"], case["chunk"], keep=caches)
        for backend in (Float32Backend(model), TorchBackend(model))
    )
    for mine, reference in zip(ours, theirs):
        assert mine.shape == (len(rows), config.vocab_size) and mine.dtype == torch.float32
        torch.testing.assert_close(mine, reference, atol=1e-4, rtol=1e-4)
    for row in range(len(rows) if SLIDING_ATTENTION not in config.layer_types else 0):
        for cache in caches:  # (row_state reads rows whose token ids are declared)
            cache.declare_tokens(row, rows[row] + tokens[row].tolist())
        mine, reference = (cache.row_state(row) for cache in caches)
        for a, b in zip((*mine.keys, *mine.values), (*reference.keys, *reference.values)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # after each row's last token (the prompt's, then every decoded one but the last, which
    # `paged_logits` decodes last), its logits are those of a solo forward of its whole sequence
    with torch.inference_mode():
        for index, row in enumerate(rows):
            sequence = row + tokens[index].tolist()
            solo = model(torch.tensor([sequence]), use_cache=False).logits[0, -1]
            torch.testing.assert_close(ours[-1][index], solo, atol=1e-4, rtol=1e-4)


def _decode_after(backend, model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, vocab) of one decode step on `backend` after a prefill of ids[:, :-1], on a
    paged cache."""
    return paged_logits(model, backend, ids[:, :-1], ids[:, -1:])[-1]


def test_a_few_tokens_run_on_the_kernels_and_many_on_onednns_copy_made_once():
    model = random_model(tiny_config(), 9)
    backend = Float32Backend(model)
    laid_out = backend._laid_out  # made with the backend
    assert laid_out is not None
    assert backend.products(3)[0] is laid_out[0]  # (a prompt of 3 rows x 5 tokens runs on it)
    ids = torch.randint(0, 64, (3, 6), generator=torch.Generator().manual_seed(5))
    for rows in (ids[:1], ids):
        torch.testing.assert_close(
            _decode_after(backend, model, rows), _decode_after(TorchBackend(model), model, rows),
            atol=1e-4, rtol=1e-4)
    assert backend._laid_out is laid_out  # kept
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(0.5)  # in place: the packed arrays see it
    for rows in (ids[:1], ids):  # so do both paths (the copy is made again)
        torch.testing.assert_close(
            _decode_after(backend, model, rows), _decode_after(TorchBackend(model), model, rows),
            atol=1e-4, rtol=1e-4)
    assert backend._laid_out is not laid_out


def test_the_rope_table_grows_past_its_first_block():
    model = random_model(tiny_config(max_position_embeddings=1024), 8)
    ids = torch.randint(0, 64, (2, 300), generator=torch.Generator().manual_seed(4))
    ours = _decode_after(Float32Backend(model), model, ids)  # position 299: past the first 256 rows
    torch.testing.assert_close(ours, _decode_after(TorchBackend(model), model, ids), atol=1e-4, rtol=1e-4)


def test_a_dynamic_rope_model_checks_its_range_on_both_backends():
    """Dynamic NTK scaling is refused past max_position_embeddings on both paths alike."""
    config = ModelConfig(
        model_type="llama",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        max_position_embeddings=4,
        rope_scaling=RopeScaling(rope_type="dynamic", factor=2.0),
        layer_types=(FULL_ATTENTION,),
    )
    model = random_model(config, 5)
    logits = {}
    for backend in (Float32Backend(model), TorchBackend(model)):
        logits[backend.name] = _decode_after(backend, model, torch.tensor([[1, 2, 3, 4]]))
        with pytest.raises(ConfigError, match="dynamic RoPE scaling"):
            _decode_after(backend, model, torch.tensor([[1, 2, 3, 4, 5]]))
    torch.testing.assert_close(logits["float32"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_out_of_range_ids_are_refused_like_the_embedding_refuses_them():
    model = random_model(tiny_config(), 9)
    backend = Float32Backend(model)
    for bad in (-1, 64):
        with pytest.raises(IndexError, match="token ids must lie in"):
            paged_logits(model, backend, torch.tensor([[1, 2]]), torch.tensor([[bad]]))


def test_a_model_it_cannot_stand_in_for_is_refused_with_the_reason():
    """The step calls no module, so it refuses a model whose modules would do more than the
    forwards it computes, and weights it cannot read: a named error, never a silent bypass."""
    from kvcache.model.llama import MLP

    model = random_model(tiny_config(), 10)
    layer = model.model.layers[1]
    handles = [
        lambda: layer.register_forward_hook(lambda *args: None),
        lambda: layer.mlp.register_forward_pre_hook(lambda *args: None),
        lambda: torch.nn.modules.module.register_module_forward_hook(lambda *args: None),
    ]
    for register in handles:
        handle = register()
        try:
            with pytest.raises(BackendError, match="hook"):
                Float32Backend(model)
        finally:
            handle.remove()
    layer.forward = lambda *args, **kwargs: None
    with pytest.raises(BackendError, match="its own forward"):
        Float32Backend(model)
    del layer.forward

    class LoudMLP(MLP):
        def forward(self, x):
            return 3 * super().forward(x)

    old = layer.mlp
    layer.mlp = LoudMLP(model.config)
    with pytest.raises(BackendError, match="LoudMLP"):
        Float32Backend(model)
    layer.mlp = old
    with pytest.raises(BackendError, match="float32 on CPU"):
        Float32Backend(random_model(tiny_config(), 11).to(torch.bfloat16))
    Float32Backend(model)  # every hook removed: accepted again
