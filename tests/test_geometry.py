"""kvcache.geometry is the one reader of a config's geometry: the model config, the cache and the
memory planner agree with it, and with transformers' own config classes, on every family rule."""

from __future__ import annotations

import pytest

from kvcache.geometry import FULL_ATTENTION as F
from kvcache.geometry import SLIDING_ATTENTION as S
from kvcache.geometry import GeometryError, read_geometry

BASE = dict(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)

# (name, raw config.json, expected window in force, expected layer types)
CASES = [
    (
        "llama ignores a sliding_window key",
        dict(BASE, model_type="llama", sliding_window=4096),
        None,
        (F, F, F),
    ),
    ("mistral windows every layer", dict(BASE, model_type="mistral", sliding_window=8), 8, (S, S, S)),
    ("mistral with a null window", dict(BASE, model_type="mistral", sliding_window=None), None, (F, F, F)),
    (
        "qwen2 without use_sliding_window",
        dict(BASE, model_type="qwen2", sliding_window=8, max_window_layers=1),
        None,
        (F, F, F),
    ),
    (
        "qwen2 from max_window_layers on",
        dict(BASE, model_type="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=1),
        8,
        (F, S, S),
    ),
    (
        "qwen3 without use_sliding_window",
        dict(BASE, model_type="qwen3", sliding_window=8, max_window_layers=1),
        None,
        (F, F, F),
    ),
    (
        "qwen3 from max_window_layers on",
        dict(BASE, model_type="qwen3", sliding_window=8, use_sliding_window=True, max_window_layers=1),
        8,
        (F, S, S),
    ),
    (
        "qwen2 listed layer types",
        dict(BASE, model_type="qwen2", sliding_window=8, use_sliding_window=True, layer_types=[S, F, S]),
        8,
        (S, F, S),
    ),
    # gemma2 / gemma3_text configs without layer_types (the Hub's older ones): transformers' pattern
    (
        "gemma2 alternates sliding and full layers",
        dict(BASE, model_type="gemma2", sliding_window=8, query_pre_attn_scalar=4),
        8,
        (S, F, S),
    ),
    ("gemma2 without a window key gets 4096", dict(BASE, model_type="gemma2"), 4096, (S, F, S)),
    (
        "gemma3_text every sliding_window_pattern-th layer full",
        dict(BASE, model_type="gemma3_text", sliding_window=8, sliding_window_pattern=3),
        8,
        (S, S, F),
    ),
    ("gemma3_text pattern 6 by default", dict(BASE, model_type="gemma3_text", sliding_window=8), 8,
     (S, S, S)),
    (
        "listed sliding layers with no window",
        dict(BASE, model_type="mistral", sliding_window=None, layer_types=[S, F, S]),
        None,
        (F, F, F),
    ),
]


@pytest.mark.parametrize("name, raw, window, types", CASES, ids=[case[0] for case in CASES])
def test_family_rules(name, raw, window, types):
    geometry = read_geometry(raw)
    assert (geometry.sliding_window, geometry.layer_types) == (window, types)
    assert (geometry.num_layers, geometry.kv_heads, geometry.head_dim) == (3, 2, 4)


@pytest.mark.parametrize("name, raw, window, types", CASES, ids=[case[0] for case in CASES])
def test_model_cache_and_planner_read_the_same_layers(name, raw, window, types):
    from kvcache.cache import SlidingWindowLayer, make_cache
    from kvcache.memory import KVShape
    from kvcache.model import ModelConfig

    config = ModelConfig.from_dict(raw)
    assert (config.sliding_window, config.layer_types) == (window, types)
    assert read_geometry(config).layer_types == types  # re-reading the object changes nothing
    for source in (raw, config):
        cache = make_cache("dynamic", config=source)
        windowed = tuple(S if isinstance(layer, SlidingWindowLayer) else F for layer in cache.layers)
        assert windowed == types, source
    shape = KVShape.from_config(raw)
    held = shape.tokens_held(100)
    assert held == [min(100, window) if kind == S else 100 for kind in types]


@pytest.mark.parametrize("name, raw, window, types", CASES, ids=[case[0] for case in CASES])
def test_agrees_with_transformers_configs(name, raw, window, types):
    transformers = pytest.importorskip("transformers")
    classes = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "gemma2": transformers.Gemma2Config,
        "gemma3_text": transformers.Gemma3TextConfig,
    }
    theirs = classes[raw["model_type"]](**{k: v for k, v in raw.items() if k != "model_type"})
    # transformers windows a layer when a window is in force and the layer is sliding (its
    # llama keeps a stray sliding_window attribute but never reads it)
    their_window = None if raw["model_type"] == "llama" else theirs.sliding_window
    their_types = getattr(theirs, "layer_types", None) or [S] * 3
    expected = tuple(S if their_window is not None and kind == S else F for kind in their_types)
    assert (their_window, expected) == (window, types)
    assert read_geometry(theirs).layer_types == types  # their object, read by us


def test_head_dim_falls_back_to_hidden_over_heads():
    assert read_geometry(dict(hidden_size=64, num_attention_heads=8)).head_dim == 8
    assert read_geometry(dict(hidden_size=64, num_attention_heads=8, head_dim=32)).head_dim == 32


def test_text_config_of_a_multimodal_config():
    raw = {"model_type": "llava", "text_config": dict(BASE, model_type="mistral", sliding_window=8)}
    assert read_geometry(raw).layer_types == (S, S, S)


@pytest.mark.parametrize(
    "raw, match",
    [
        (dict(num_hidden_layers="3"), "num_hidden_layers must be a positive integer"),
        (dict(num_hidden_layers=0), "num_hidden_layers must be a positive integer"),
        (dict(hidden_size=10, num_attention_heads=3), "not divisible"),
        (dict(num_hidden_layers=2, layer_types=[F]), "lists 1 layers but num_hidden_layers is 2"),
        (dict(num_hidden_layers=1, layer_types=["chunked"]), "may hold"),
        (
            dict(
                model_type="qwen2",
                num_hidden_layers=2,
                sliding_window=4,
                use_sliding_window=True,
                max_window_layers=-1,
            ),
            "max_window_layers",
        ),
    ],
)
def test_bad_fields_are_named(raw, match):
    with pytest.raises(GeometryError, match=match):
        read_geometry(raw)


def test_require_names_the_config_fields():
    with pytest.raises(GeometryError, match="num_hidden_layers, head_dim or hidden_size"):
        read_geometry({"num_attention_heads": 4}).require("num_layers", "head_dim")


def test_a_llama_model_config_with_a_window_is_refused():
    import dataclasses

    from kvcache.model import ConfigError, ModelConfig

    config = ModelConfig.from_dict(dict(BASE, model_type="llama"))
    with pytest.raises(ConfigError, match="mistral"):
        dataclasses.replace(config, sliding_window=4, layer_types=(S, S, S))
