"""ModelConfig reads config.json as transformers does, and RoPE frequencies match its own."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_models import ARCHS, hf_model

from kvcache.model import ConfigError, ModelConfig
from kvcache.model.rope import RotaryEmbedding, apply_rope, inverse_frequencies


def _raw(model) -> dict:
    return json.loads(model.config.to_json_string())


@pytest.mark.parametrize("arch", ARCHS)
def test_config_reads_layer_types_and_window_like_transformers(arch):
    hf = hf_model(arch)
    config = ModelConfig.from_dict(_raw(hf))
    assert config.num_key_value_heads == 2 and config.head_dim == 16
    assert config.num_key_value_groups == 2
    expected_window = getattr(hf.config, "sliding_window", None)
    assert config.sliding_window == expected_window
    hf_types = getattr(hf.config, "layer_types", None) or (
        ["sliding_attention" if expected_window else "full_attention"] * config.num_hidden_layers
    )
    assert list(config.layer_types) == list(hf_types)
    assert config.qkv_bias == arch.startswith("qwen2") and not config.o_bias
    tied = arch in ("qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
    assert config.tie_word_embeddings == bool(hf.config.tie_word_embeddings) == tied
    assert config.qk_norm == {"qwen3": "head", "olmo2": "width", "gemma3_text": "head"}.get(arch)
    sandwich = {"gemma2": "sandwich", "gemma3_text": "sandwich"}
    assert config.norm_placement == {"olmo2": "post", **sandwich}.get(arch, "pre")


def test_qwen2_window_is_off_unless_use_sliding_window():
    raw = _raw(hf_model("qwen2"))
    raw.update(sliding_window=4096, use_sliding_window=False, max_window_layers=1)
    config = ModelConfig.from_dict(raw)
    assert config.sliding_window is None
    assert set(config.layer_types) == {"full_attention"}


def test_config_is_frozen():
    config = ModelConfig.from_dict(_raw(hf_model("llama")))
    with pytest.raises(AttributeError):
        config.hidden_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"model_type": "gpt2"}, "model_type 'gpt2'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope scaling type 'longrope'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs factor"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
        ({"vocab_size": None}, "vocab_size"),
    ],
)
def test_unsupported_settings_are_refused_by_name(change, named):
    raw = {**_raw(hf_model("llama")), **change}
    with pytest.raises(ConfigError, match=named):
        ModelConfig.from_dict(raw)


def test_legacy_rope_scaling_field_is_read():
    raw = _raw(hf_model("llama"))
    raw.pop("rope_parameters")
    raw.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})
    config = ModelConfig.from_dict(raw)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 2.0


ROPE_CASES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    },
    "dynamic": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
}


@pytest.mark.parametrize("kind", sorted(ROPE_CASES))
def test_rope_cos_sin_equal_transformers(kind):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    hf = hf_model("llama", rope_parameters=dict(ROPE_CASES[kind]), max_position_embeddings=256)
    config = ModelConfig.from_dict(_raw(hf))
    theirs = LlamaRotaryEmbedding(hf.config)
    positions = torch.arange(0, 200).unsqueeze(0)
    cos, signed_sin = RotaryEmbedding(config)(positions, torch.float32)
    hf_cos, hf_sin = theirs(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos[:, 0], hf_cos, atol=1e-6, rtol=0)
    x = torch.randn(1, 3, positions.shape[1], config.head_dim)
    rotated, _ = apply_rotary_pos_emb(x, x, hf_cos, hf_sin)
    torch.testing.assert_close(apply_rope(x, cos, signed_sin), rotated, atol=1e-5, rtol=0)
    if kind == "llama3":  # the ramp really changes some frequencies
        assert not torch.equal(
            inverse_frequencies(config),
            RotaryEmbedding(
                ModelConfig.from_dict({**_raw(hf), "rope_parameters": ROPE_CASES["default"]})
            ).inv_freq,
        )


def test_dynamic_rope_past_max_positions_is_refused():
    hf = hf_model("llama", rope_parameters=dict(ROPE_CASES["dynamic"]), max_position_embeddings=32)
    rope = RotaryEmbedding(ModelConfig.from_dict(_raw(hf)))
    rope(torch.arange(32)[None], torch.float32)
    with pytest.raises(ConfigError, match="dynamic RoPE scaling beyond max_position_embeddings=32"):
        rope(torch.arange(33)[None], torch.float32)


@pytest.mark.parametrize("name, value", [("num_hidden_layers", 10**7), ("num_attention_heads", 10**6),
                                         ("hidden_size", 10**9), ("vocab_size", 10**9),
                                         ("intermediate_size", 10**9), ("max_position_embeddings", 10**12),
                                         ("head_dim", 10**6), ("sliding_window", 10**10)])
def test_absurd_sizes_in_a_config_are_refused_before_anything_is_sized_by_them(name, value):

    from kvcache.memory import KVShape
    from kvcache.model import ConfigError, ModelConfig

    raw = {"model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 64,
           "sliding_window": 8, name: value}
    with pytest.raises(ConfigError, match=f"{name}={value:,} is past the largest"):
        ModelConfig.from_dict(raw)
    if name in ("num_hidden_layers", "num_attention_heads", "hidden_size", "head_dim", "sliding_window"):
        with pytest.raises(ValueError, match="past the largest"):
            KVShape.from_config(raw)


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text"])
def test_a_gemma_config_leaving_fields_out_reads_as_transformers_defaults_them(arch):
    import transformers

    raw = _raw(hf_model(arch))
    for name in ("tie_word_embeddings", "query_pre_attn_scalar", "attn_logit_softcapping",
                 "final_logit_softcapping", "hidden_activation", "hidden_act", "layer_types",
                 "sliding_window", "rope_parameters"):
        raw.pop(name, None)
    theirs = transformers.AutoConfig.for_model(**raw)
    config = ModelConfig.from_dict(raw)
    assert config.tie_word_embeddings == theirs.tie_word_embeddings
    assert config.hidden_act == getattr(theirs, "hidden_activation", None) or theirs.hidden_act
    assert config.attn_logit_softcap == getattr(theirs, "attn_logit_softcapping", None)
    assert config.final_logit_softcap == getattr(theirs, "final_logit_softcapping", None)
    if arch != "gemma":
        assert config.attention_scale == theirs.query_pre_attn_scalar**-0.5
        assert config.sliding_window == theirs.sliding_window
        assert list(config.layer_types) == theirs.layer_types
    if arch == "gemma3_text":
        params = theirs.rope_parameters
        assert config.rope_theta == params["full_attention"]["rope_theta"]
        assert config.local_rope_theta == params["sliding_attention"]["rope_theta"]


def test_gemma_legacy_gelu_is_the_tanh_approximation_and_gemma3_scaled_local_rope_is_refused():
    raw = _raw(hf_model("gemma"))
    raw["hidden_act"] = "gelu"
    assert ModelConfig.from_dict(raw).hidden_act == "gelu_pytorch_tanh"  # as transformers reads it
    raw = _raw(hf_model("gemma3_text"))
    raw["rope_parameters"]["sliding_attention"] = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    with pytest.raises(ConfigError, match="sliding layers"):
        ModelConfig.from_dict(raw)
    legacy = _raw(hf_model("gemma3_text"))
    del legacy["rope_parameters"]
    legacy.update(rope_theta=5e5, rope_local_base_freq=2e3,
                  rope_scaling={"rope_type": "linear", "factor": 4.0})
    config = ModelConfig.from_dict(legacy)
    assert (config.rope_theta, config.local_rope_theta, config.rope_scaling.factor) == (5e5, 2e3, 4.0)
    import transformers

    theirs = transformers.AutoConfig.for_model(**legacy).rope_parameters  # read alike
    assert (theirs["full_attention"]["rope_theta"], theirs["sliding_attention"]["rope_theta"],
            theirs["full_attention"]["factor"]) == (5e5, 2e3, 4.0)
