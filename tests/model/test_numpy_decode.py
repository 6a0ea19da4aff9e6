"""The numpy decode step computes what the torch forward computes, on any shape the model takes.

Two copies of one random model state step side by side with their own caches: one with the
torch path, one with the numpy step (matvec_backend="numpy"). Logits must agree to float32
rounding, and so must what each cache holds, for every cache kind, padded batches, grouped-query
attention, biases, tied embeddings and sliding-window layers.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import randomize_weights
from torch import nn

from kvcache.generation.loop import build_cache
from kvcache.model.config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from kvcache.model.kernels import fuse_projections, store_tall_weights_transposed
from kvcache.model.llama import LlamaForCausalLM

np = pytest.importorskip("numpy")


def random_model(config: ModelConfig, seed: int, transposed: bool = False) -> LlamaForCausalLM:
    """A model with every weight random (norm weights and biases too), fused as load_model does
    (and with its tall weights stored column-major, as for the numpy step, if `transposed`)."""
    torch.manual_seed(seed)
    model = randomize_weights(LlamaForCausalLM(config))
    fuse_projections(model)
    if transposed:
        store_tall_weights_transposed(model)
    return model.eval()


@st.composite
def cases(draw):
    kv_heads = draw(st.integers(1, 3))
    heads = kv_heads * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([4, 8, 16]))
    layers = draw(st.integers(1, 3))
    window = draw(st.none() | st.integers(2, 6))
    bias = draw(st.sampled_from(["none", "qkv", "all"]))
    config = ModelConfig(
        model_type="llama" if window is None else "mistral",
        vocab_size=draw(st.integers(8, 40)),
        hidden_size=draw(st.sampled_from([8, 16, 24])),
        intermediate_size=draw(st.integers(4, 40)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=64,
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])),
        rope_theta=draw(st.sampled_from([100.0, 10000.0])),
        tie_word_embeddings=draw(st.booleans()),
        qkv_bias=bias != "none",
        o_bias=bias == "all",
        mlp_bias=bias == "all",
        sliding_window=window,
        layer_types=tuple(
            draw(st.sampled_from([FULL_ATTENTION, SLIDING_ATTENTION])) if window else FULL_ATTENTION
            for _ in range(layers)
        ),
    )
    kinds = ["dynamic", "static", "quantized"]
    if SLIDING_ATTENTION not in config.layer_types:
        kinds.append("paged")  # it holds full-attention layers only
    elif FULL_ATTENTION not in config.layer_types:
        kinds.append("sliding")  # its rings window every layer
    batch = draw(st.integers(1, 3))
    prompt = draw(st.integers(1, 7))
    padding = [draw(st.integers(0, prompt - 1)) for _ in range(batch)]
    return dict(
        config=config,
        cache=draw(st.sampled_from(kinds)),
        batch=batch,
        prompt=prompt,
        padding=padding,
        steps=draw(st.integers(1, 8)),
        seed=draw(st.integers(0, 2**16)),
        transposed=draw(st.booleans()),
    )


@settings(max_examples=60, deadline=None)
@given(case=cases())
def test_numpy_step_equals_the_torch_forward(case):
    config, batch, prompt = case["config"], case["batch"], case["prompt"]
    model = random_model(config, case["seed"], case["transposed"])
    generator = torch.Generator().manual_seed(case["seed"])
    ids = torch.randint(0, config.vocab_size, (batch, prompt), generator=generator)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    for row, pad in enumerate(case["padding"]):
        mask[row, :pad] = 0
    padded = bool((mask == 0).any())
    total = prompt + case["steps"]
    caches = {}
    with torch.inference_mode():
        for backend in ("torch", "numpy"):
            model.matvec_backend = "torch"  # the prompt always runs on the torch path
            caches[backend] = build_cache(model, case["cache"], batch, total)
            model(ids, attention_mask=mask, past_key_values=caches[backend])
        step_mask = mask
        for _ in range(case["steps"]):
            token = torch.randint(0, config.vocab_size, (batch, 1), generator=generator)
            step_mask = torch.cat([step_mask, torch.ones(batch, 1, dtype=torch.long)], dim=1)
            logits = {}
            for backend in ("torch", "numpy"):
                model.matvec_backend = backend
                out = model(
                    token, attention_mask=step_mask if padded else None, past_key_values=caches[backend]
                )
                logits[backend] = out.logits
            assert logits["numpy"].shape == (batch, 1, config.vocab_size)
            assert logits["numpy"].dtype == torch.float32
            torch.testing.assert_close(logits["numpy"], logits["torch"], atol=1e-4, rtol=1e-4)
    for layer in range(config.num_hidden_layers):
        ours, theirs = caches["numpy"].layers[layer], caches["torch"].layers[layer]
        assert ours.get_seq_length() == theirs.get_seq_length()
        torch.testing.assert_close(ours.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_numpy_step_is_taken_for_decode_rows_only(llama_dir):
    from kvcache import load_model

    model = load_model(llama_dir, matvec="numpy")
    assert not model._numpy_step_applies(batch=1, new_tokens=1)  # gradients on: torch
    with torch.no_grad():
        assert model._numpy_step_applies(batch=1, new_tokens=1)
        assert model._numpy_step_applies(batch=8, new_tokens=1)
        assert not model._numpy_step_applies(batch=1, new_tokens=2)  # prefill: torch GEMM
        assert not model._numpy_step_applies(batch=9, new_tokens=1)
        bf16 = load_model(llama_dir, matvec="numpy", dtype=torch.bfloat16)
        assert bf16._numpy_decoder().step(torch.tensor([[1]]), torch.tensor([[0]]), None, None) is None
        model.matvec_backend = "torch"
        assert not model._numpy_step_applies(batch=1, new_tokens=1)


def _decode_logits(model, ids):
    """Logits of one decode step after a prompt, both on the model's current backend."""
    with torch.inference_mode():
        out = model(ids[:, :-1])
        return model(ids[:, -1:], past_key_values=out.past_key_values).logits


def test_numpy_step_sees_a_replaced_or_moved_weight(llama_dir):
    from kvcache import load_model

    model = load_model(llama_dir, matvec="numpy")
    ids = torch.randint(3, 259, (1, 6), generator=torch.Generator().manual_seed(3))
    before = _decode_logits(model, ids)  # builds the numpy views
    attn = model.model.layers[1].self_attn
    attn.k_proj.weight = nn.Parameter(torch.zeros_like(attn.k_proj.weight))  # a new Parameter
    replaced = _decode_logits(model, ids)
    model.matvec_backend = "torch"
    torch.testing.assert_close(replaced, _decode_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(before, replaced)

    model.matvec_backend = "numpy"
    down = model.model.layers[0].mlp.down_proj
    down.weight.data = down.weight.data * 2  # same Parameter, new storage
    moved = _decode_logits(model, ids)
    model.matvec_backend = "torch"
    torch.testing.assert_close(moved, _decode_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(replaced, moved)


def test_numpy_step_on_a_dynamic_rope_model_checks_its_range(tmp_path):
    """Dynamic NTK scaling is refused past max_position_embeddings on both paths alike."""
    from kvcache.model.config import ConfigError, RopeScaling

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
    for backend in ("torch", "numpy"):
        model.matvec_backend = backend
        logits[backend] = _decode_logits(model, torch.tensor([[1, 2, 3, 4]]))
        with pytest.raises(ConfigError, match="dynamic RoPE scaling"):
            _decode_logits(model, torch.tensor([[1, 2, 3, 4, 5]]))
    torch.testing.assert_close(logits["numpy"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_numpy_loading_keeps_the_checkpoint_values_names_and_shapes(llama_dir):
    """The numpy step's column-major tall weights are a layout only: state_dict is the file's."""
    from safetensors.torch import load_file

    from kvcache import load_model

    stored = load_file(str(llama_dir / "model.safetensors"))
    model = load_model(llama_dir, matvec="numpy")
    fused = model.model.layers[0].mlp.fused_gate_up.weight  # (2·inner, hidden)
    assert fused.t().is_contiguous() and fused.is_contiguous() is False  # stored column-major
    assert model.model.layers[0].mlp.gate_proj.weight.stride() == (1, fused.shape[0])
    state = model.state_dict()
    for name, tensor in stored.items():
        assert state[name].shape == tensor.shape and torch.equal(state[name], tensor), name


def _small_config(**overrides) -> ModelConfig:
    settings = dict(
        model_type="llama", vocab_size=40, hidden_size=16, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
        layer_types=(FULL_ATTENTION, FULL_ATTENTION),
    )
    if overrides.get("sliding_window") is not None:
        settings["model_type"] = "mistral"  # a llama config has no window
    return ModelConfig(**{**settings, **overrides})


def _both_paths(model, ids) -> dict[str, torch.Tensor]:
    logits = {}
    for backend in ("torch", "numpy"):
        model.matvec_backend = backend
        logits[backend] = _decode_logits(model, ids)
    return logits


def test_numpy_step_sees_weights_written_in_place_and_replaced_modules():
    model = random_model(_small_config(), 7)
    model.model.layers[0].self_attn.fused_qkv = None  # the step keeps a concatenated q/k/v copy
    ids = torch.randint(0, 40, (1, 9), generator=torch.Generator().manual_seed(2))
    first = _both_paths(model, ids)
    torch.testing.assert_close(first["numpy"], first["torch"], atol=1e-4, rtol=1e-4)

    state = {name: tensor * 1.5 for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        model.load_state_dict(state)  # in place: same Parameters, same pointers, new versions
    written = _both_paths(model, ids)
    torch.testing.assert_close(written["numpy"], written["torch"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(written["numpy"], first["numpy"])

    new_head = nn.Linear(16, 40, bias=False)
    model.lm_head = new_head  # a whole module replaced
    replaced = _both_paths(model, ids)
    torch.testing.assert_close(replaced["numpy"], replaced["torch"], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(replaced["numpy"], written["numpy"])


def test_numpy_step_rope_table_grows_past_its_first_block():
    model = random_model(_small_config(), 8, transposed=True)
    ids = torch.randint(0, 40, (2, 300), generator=torch.Generator().manual_seed(4))
    logits = _both_paths(model, ids)  # positions up to 299: past the first 256-row table
    torch.testing.assert_close(logits["numpy"], logits["torch"], atol=1e-4, rtol=1e-4)


def test_numpy_step_refuses_out_of_range_ids_like_the_embedding():
    model = random_model(_small_config(), 9)
    model.matvec_backend = "numpy"
    with torch.inference_mode():
        cache = model(torch.tensor([[1, 2]])).past_key_values
        for bad in (-1, 40):
            with pytest.raises(IndexError, match="token ids must lie in"):
                model(torch.tensor([[bad]]), past_key_values=cache)


def test_eos_given_as_tensors_stops_generation():
    from kvcache import generate

    model = random_model(_small_config(), 10)
    model.matvec_backend = "numpy"
    free = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=6, eos_token_id=())
    stop = free.new_tokens[0][2]
    ended = generate(model, torch.tensor([[1, 2, 3]]), max_new_tokens=6, eos_token_id=[torch.tensor(stop)])
    assert ended.stop_reasons == ["eos"] and ended.new_tokens[0][-1] == stop
    assert len(ended.new_tokens[0]) <= 3


def test_numpy_step_leaves_hooked_models_to_the_torch_path():
    """A forward hook (or pre-hook, or a global one, or an instance-level forward) on any module
    would be bypassed by the numpy step, so the step declines while one is registered."""
    model = random_model(_small_config(), 10)
    model.matvec_backend = "numpy"
    ids = torch.randint(0, 40, (1, 5), generator=torch.Generator().manual_seed(5))
    layer = model.model.layers[1]
    register = [
        lambda seen: layer.register_forward_hook(lambda *args: seen.append("hook")),
        lambda seen: layer.mlp.register_forward_pre_hook(lambda *args: seen.append("pre")),
        lambda seen: torch.nn.modules.module.register_module_forward_hook(
            lambda *args: seen.append("global")
        ),
    ]
    for add in register:
        seen: list[str] = []
        handle = add(seen)
        try:
            _decode_logits(model, ids)  # a prefill of 4 tokens, then one decode step
        finally:
            handle.remove()
        calls_per_forward = len(seen) // 2
        assert calls_per_forward >= 1 and len(seen) == 2 * calls_per_forward, seen  # decode too

    original = layer.forward
    calls: list[int] = []
    layer.forward = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
    try:
        _decode_logits(model, ids)
    finally:
        del layer.forward
    assert len(calls) == 2


def test_generate_sees_what_a_streamer_changes_from_the_next_step():
    """generate checks the numpy step's views after every streamer call: a streamer that
    replaces lm_head at step 2 or registers a hook changes the following steps on both paths."""
    from kvcache import generate

    model = random_model(_small_config(), 11, transposed=True)
    prompt = torch.randint(0, 40, (1, 6), generator=torch.Generator().manual_seed(6))
    new_head = nn.Linear(16, 40, bias=False)
    with torch.no_grad():
        new_head.weight.copy_(torch.randn(40, 16, generator=torch.Generator().manual_seed(7)))
    results = {}
    for backend in ("torch", "numpy"):
        model.matvec_backend = backend
        old_head = model.lm_head
        steps: list[int] = []
        hooked: list[int] = []

        def streamer(tokens, steps=steps, hooked=hooked):
            steps.append(int(tokens[0]))
            if len(steps) == 2:
                model.lm_head = new_head
            if len(steps) == 4:
                model.model.layers[0].register_forward_hook(lambda *args: hooked.append(1))

        results[backend] = generate(model, prompt, max_new_tokens=6, eos_token_id=(), streamer=streamer)
        model.lm_head = old_head
        model.model.layers[0]._forward_hooks.clear()
        assert len(hooked) == 2  # steps 5 and 6 ran the hooked layer
    assert results["numpy"].new_tokens == results["torch"].new_tokens
    model.matvec_backend = "numpy"
    unchanged = generate(model, prompt, max_new_tokens=6, eos_token_id=())
    assert unchanged.new_tokens != results["numpy"].new_tokens  # the new head did change tokens


def test_numpy_step_leaves_modules_of_other_classes_to_the_torch_path():
    """A submodule replaced by one of another class (here an MLP subclass that scales its
    output), or a model subclass with its own forward, is called, not re-implemented."""
    from kvcache import generate
    from kvcache.model.llama import MLP

    class LoudMLP(MLP):
        def forward(self, x):
            return 3 * super().forward(x)

    model = random_model(_small_config(), 12)
    old = model.model.layers[0].mlp
    loud = LoudMLP(model.config)
    loud.load_state_dict(old.state_dict())
    model.model.layers[0].mlp = loud
    ids = torch.randint(0, 40, (1, 7), generator=torch.Generator().manual_seed(8))
    logits = _both_paths(model, ids)
    torch.testing.assert_close(logits["numpy"], logits["torch"], atol=1e-4, rtol=1e-4)
    model.model.layers[0].mlp = old
    assert not torch.allclose(_both_paths(model, ids)["numpy"], logits["numpy"])

    class LastId(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 0 + torch.arange(out.logits.shape[-1]).float()  # picks the last id
            return out

    last_id = LastId(model.config)
    last_id.load_state_dict(model.state_dict())
    last_id.eval().matvec_backend = "numpy"
    result = generate(last_id, ids, max_new_tokens=3, eos_token_id=())
    assert result.new_tokens[0] == [39, 39, 39]
