"""The memory planner reads every family's config.json as the model does: the bytes it predicts
for a sequence equal what the model's own cache holds after that sequence (head_dim apart from
hidden / heads in qwen3 and gemma2, windows on some layers or all)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import ARCHS

from kvcache import load_model
from kvcache.memory import KVShape


@pytest.mark.parametrize("arch", ARCHS)
def test_planner_bytes_equal_the_models_cache(checkpoints, arch):
    folder, _ = checkpoints[arch]
    model = load_model(folder)
    tokens = 20  # longer than the test windows (4)
    with torch.no_grad():
        cache = model(torch.randint(3, 259, (1, tokens))).past_key_values
    shape = KVShape.from_config(folder)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
    )
    assert cache.nbytes_used == shape.bytes(tokens, dtype="float32")


DICT_CONFIGS = {
    # transformers ignores a llama config's sliding_window: so do the model, the cache and the planner
    "llama with an unused sliding_window": dict(model_type="llama", sliding_window=8),
    # qwen2 slides the layers from max_window_layers on, only with use_sliding_window
    "qwen2, max_window_layers 2": dict(model_type="qwen2", sliding_window=8, use_sliding_window=True,
                                       max_window_layers=2),
    "qwen2 without use_sliding_window": dict(model_type="qwen2", sliding_window=8, max_window_layers=2),
}


@pytest.mark.parametrize("case", list(DICT_CONFIGS))
@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_config_dict_is_read_as_the_model_reads_it_by_cache_planner_and_model(case, kind):
    from kvcache.cache import make_cache
    from kvcache.model import LlamaForCausalLM, ModelConfig

    raw = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **DICT_CONFIGS[case])
    model = LlamaForCausalLM(ModelConfig.from_dict(raw)).eval()
    cache = make_cache(kind, config=raw, max_cache_len=32)
    tokens = 20
    with torch.no_grad():
        model(torch.randint(0, 64, (1, tokens)), past_key_values=cache)
    windows = [layer.window for layer in cache.layers]
    assert windows == list(model.config.layer_windows)  # the cache keeps what the model attends to
    assert cache.nbytes_used == KVShape.from_config(raw).bytes(tokens, dtype="float32")


@pytest.mark.parametrize("arch", ARCHS)
def test_parameter_count_equals_the_weights_of_the_model_and_of_transformers(checkpoints, arch):
    from kvcache.model.parameters import parameter_count, weight_bytes

    folder, hf = checkpoints[arch]
    model = load_model(folder)
    counted = parameter_count(model.config)
    assert counted == sum(p.numel() for p in model.parameters())  # a tied lm_head once
    assert counted == sum(p.numel() for p in hf.parameters())
    assert weight_bytes(model.config, "bfloat16") == 2 * counted


@pytest.mark.parametrize("bias", [dict(attention_bias=True), dict(mlp_bias=True)])
def test_parameter_count_includes_a_llamas_optional_biases(bias):
    from tiny_models import tiny_config

    from kvcache.model import LlamaForCausalLM
    from kvcache.model.parameters import parameter_count

    config = tiny_config(**bias)
    assert parameter_count(config) == sum(p.numel() for p in LlamaForCausalLM(config).parameters())
