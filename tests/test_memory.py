"""kvcache.memory: the 2·L·H·T·D·bytes formula, configs, sliding layers, capacity."""

import json

import pytest

from kvcache import memory
from kvcache.memory import KVShape


def test_elements_and_bytes_per_dtype():
    assert memory.kv_cache_elements(2, 3, 5, 7, batch=11) == 2 * 2 * 3 * 5 * 7 * 11
    expected = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}
    for dtype, size in expected.items():
        assert memory.kv_cache_bytes(2, 3, 5, 7, dtype=dtype) == 2 * 2 * 3 * 5 * 7 * size
    assert memory.kv_cache_bytes(2, 3, 5, 7, dtype="int4") == 2 * 3 * 5 * 7  # half a byte
    assert memory.kv_cache_bytes(1, 1, 1, 1, dtype="int4") == 1


def test_unknown_dtype_lists_known_and_negative_sizes_fail():
    with pytest.raises(ValueError, match="known: float64, float32"):
        memory.kv_cache_bytes(1, 1, 1, 1, dtype="float12")
    with pytest.raises(ValueError, match="seq_len must be ≥ 0, got -1"):
        memory.kv_cache_elements(1, 1, -1, 1)
    with pytest.raises(ValueError, match="batch must be ≥ 0"):
        memory.kv_cache_bytes(1, 1, 1, 1, batch=-2)


def write_config(tmp_path, **fields):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def test_from_config_llama_with_gqa_and_head_dim_fallback(tmp_path):
    path = write_config(tmp_path, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, hidden_size=2048)
    shape = KVShape.from_config(path)
    assert (shape.layers, shape.kv_heads, shape.head_dim) == (16, 8, 64)
    assert KVShape.from_config(tmp_path) == shape  # the folder works too
    assert shape.bytes(1000, 2, "bfloat16") == memory.kv_cache_bytes(16, 8, 1000, 64, 2, "bfloat16")


def test_from_config_without_kv_heads_falls_back_to_attention_heads():
    shape = KVShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                                 "hidden_size": 999})
    assert (shape.kv_heads, shape.head_dim) == (4, 16)


def test_mistral_window_caps_every_layer():
    shape = KVShape.from_config({"num_hidden_layers": 4, "num_attention_heads": 8,
                                 "num_key_value_heads": 2, "hidden_size": 256,
                                 "sliding_window": 100})
    assert shape.tokens_held(50) == [50] * 4
    assert shape.tokens_held(1000) == [100] * 4
    assert shape.bytes(1000) == shape.bytes(100)
    assert memory.max_tokens(shape, shape.bytes(100)) is None
    assert memory.max_tokens(shape, shape.bytes(100) - 1) == 99


def test_qwen2_window_is_ignored_when_disabled_and_layer_types_mix():
    qwen = KVShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
                                "sliding_window": 4, "use_sliding_window": False})
    assert qwen.tokens_held(10) == [10, 10]
    mixed = KVShape.from_config({
        "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 4, "sliding_window": 4,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]})
    assert mixed.tokens_held(10) == [4, 4, 10]
    assert mixed.bytes(10, dtype="float32") == 2 * 2 * 4 * (4 + 4 + 10) * 4


def test_text_config_is_used_for_multimodal_configs():
    shape = KVShape.from_config({"text_config": {"num_hidden_layers": 3, "num_attention_heads": 2,
                                                 "head_dim": 8}})
    assert shape.layers == 3


def test_config_missing_fields_names_them(tmp_path):
    with pytest.raises(ValueError, match="num_hidden_layers.*head_dim or hidden_size"):
        KVShape.from_config({"num_attention_heads": 2})
    with pytest.raises(ValueError, match="no config.json"):
        KVShape.from_config(tmp_path / "nowhere")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        KVShape.from_config(bad)
    with pytest.raises(ValueError, match="not divisible"):
        KVShape.from_config({"num_hidden_layers": 1, "num_attention_heads": 3, "hidden_size": 8})


@pytest.mark.parametrize("budget", [0, 1, 63, 64, 65, 1000, 4096, 123457])
@pytest.mark.parametrize("batch", [1, 3])
def test_max_tokens_is_the_largest_fitting_length(budget, batch):
    shape = KVShape(layers=2, kv_heads=1, head_dim=4)  # 2·2·1·4·2 = 32 B per token in fp16
    longest = memory.max_tokens(shape, budget, batch)
    assert shape.bytes(longest, batch) <= budget < shape.bytes(longest + 1, batch)


def test_max_tokens_with_mixed_layers_grows_past_the_window():
    shape = KVShape(layers=2, kv_heads=1, head_dim=1, sliding_window=3,
                    layer_types=("sliding_attention", "full_attention"))
    budget = shape.bytes(10, dtype="int8")
    assert memory.max_tokens(shape, budget, dtype="int8") == 10


def test_max_sequences_and_size_parsing():
    shape = KVShape(layers=32, kv_heads=8, head_dim=128)
    one = shape.bytes(4096, 1, "bfloat16")
    assert one == 512 * 2**20
    assert memory.max_sequences(shape, memory.parse_size("24GiB"), 4096, "bfloat16") == 48
    assert memory.parse_size("1.5 KB") == 1500
    assert memory.parse_size("2MiB") == 2 * 2**20
    assert memory.parse_size("100") == 100
    with pytest.raises(ValueError, match="cannot read size"):
        memory.parse_size("lots")
    assert memory.format_bytes(1536) == "1.5 KiB"
    assert memory.format_bytes(2**30) == "1 GiB"
    assert memory.format_bytes(12) == "12 B"
