"""GGUF files of every family the folder loader knows beyond llama and qwen (gemma, gemma2, gemma3,
phi3, olmo2, mistral), converted from tiny checkpoints as llama.cpp's converter lays them out
(`gguf_files.write_gguf`), give the logits and greedy tokens of the transformers model they came
from; what the converter leaves out reads as llama.cpp reads it; unknown tensors, RoPE tables and
partial rotations are refused by name."""

from __future__ import annotations

import copy

import gguf
import numpy as np
import pytest
import torch
from gguf_files import write_gguf
from tiny_models import WINDOW, hf_model, save_checkpoint

from kvcache import load_model
from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcache.model import CheckpointError, LlamaForCausalLM, ModelConfig
from kvcache.model.gguf_file import config_dict
from kvcache.model.quantized import QuantizedEmbedding, QuantizedLinear

IDS = torch.tensor([[1, 5, 77, 200, 3, 9, 140, 33, 250, 12, 18]])  # longer than WINDOW
NEW_TOKENS = 12
_GEMMA3_LAYERS = [SLIDING_ATTENTION] * 5 + [FULL_ATTENTION]  # llama.cpp's pattern: every sixth full
# model_type -> hf_model overrides: queries scaled by 1/sqrt(head_dim), which a gemma2 or gemma3 file
# of any but the 27B's layer count means; gemma3 with the six-layer pattern its files imply and a
# vocabulary its converter keeps whole (the tokenizer's 259 tokens and 3 added ones)
FAMILIES = {
    "gemma": {},
    "gemma2": dict(query_pre_attn_scalar=16),
    "gemma3_text": dict(num_hidden_layers=6, layer_types=_GEMMA3_LAYERS, query_pre_attn_scalar=16,
                        vocab_size=262),
    "phi3": {},  # a window on every layer, fused projections
    "olmo2": {},
    "mistral": dict(sliding_window=None),  # converts to a llama file
}


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict[str, tuple]:
    """model_type -> (checkpoint folder, the transformers model saved there)."""
    root = tmp_path_factory.mktemp("families")
    built = {}
    for seed, (model_type, overrides) in enumerate(FAMILIES.items()):
        torch.manual_seed(100 + seed)
        model = hf_model(model_type, **overrides)
        built[model_type] = (save_checkpoint(model, root / model_type), model)
    return built


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def _greedy(model) -> list[int]:
    """NEW_TOKENS greedy tokens after IDS, each decoded on the model's own cache."""
    tokens = []
    keyword = "past_key_values" if isinstance(model, LlamaForCausalLM) else "cache"  # transformers' name
    with torch.no_grad():
        out = model(IDS, use_cache=True)
        for _ in range(NEW_TOKENS):
            token = out.logits[:, -1:].argmax(-1)  # (1, 1)
            tokens.append(int(token))
            out = model(token, use_cache=True, **{keyword: out.past_key_values})
    return tokens


def _holding(model, stored):
    """A copy of the transformers model whose matrices hold `stored(matrix)`'s values (what a
    file of F16 or quantized matrices holds; vectors stay float32, as the converter keeps them)."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for param in copied.parameters():
            if param.dim() == 2:
                param.copy_(torch.from_numpy(stored(param.numpy().astype(np.float32))))
    return copied


def _f16(matrix: np.ndarray) -> np.ndarray:
    return matrix.astype(np.float16).astype(np.float32)


def _q8_0(matrix: np.ndarray) -> np.ndarray:
    kind = gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.dequantize(gguf.quants.quantize(matrix, kind), kind).astype(np.float32)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_an_f32_file_gives_the_logits_and_greedy_tokens_of_the_transformers_model(
        families, tmp_path, model_type):
    folder, theirs = families[model_type]
    ours = load_model(write_gguf(folder, tmp_path / f"{model_type}.gguf"))
    expected_type = "llama" if model_type == "mistral" else model_type  # as llama.cpp reads it
    assert ours.config.model_type == expected_type
    assert ours.config.layer_types == load_model(folder).config.layer_types
    torch.testing.assert_close(_logits(ours), _logits(theirs), atol=1e-4, rtol=1e-4)
    assert _greedy(ours) == _greedy(theirs)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_an_f32_file_holds_the_checkpoints_weights(families, tmp_path, model_type):
    """gemma's norms come back less the 1 its converter adds; phi3's fused projections split."""
    folder, _ = families[model_type]
    from_file = load_model(write_gguf(folder, tmp_path / f"{model_type}.gguf")).state_dict()
    from_folder = load_model(folder).state_dict()
    assert from_file.keys() == from_folder.keys()
    for name, tensor in from_folder.items():  # (w + 1) - 1 in float32: within an ulp of 1
        torch.testing.assert_close(from_file[name], tensor, atol=2e-7, rtol=0, msg=name)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_an_f16_file_gives_the_logits_of_the_transformers_model_holding_its_values(
        families, tmp_path, model_type):
    folder, theirs = families[model_type]
    ours = load_model(write_gguf(folder, tmp_path / f"{model_type}.gguf", tensor_type="F16"))
    torch.testing.assert_close(_logits(ours), _logits(_holding(theirs, _f16)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_q8_0_blocks_kept_as_stored_give_the_logits_of_the_transformers_model_holding_them(
        families, tmp_path, model_type):
    """Kept blocks: phi3's fused projections split as views of the file's rows, gemma's scaled
    embedding and tied head read from blocks."""
    folder, theirs = families[model_type]
    ours = load_model(write_gguf(folder, tmp_path / f"{model_type}.gguf", tensor_type="Q8_0"))
    assert isinstance(ours.model.embed_tokens, QuantizedEmbedding)
    attention, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    kept = (attention.q_proj, attention.v_proj, mlp.up_proj)
    assert all(isinstance(module, QuantizedLinear) for module in kept)
    torch.testing.assert_close(_logits(ours), _logits(_holding(theirs, _q8_0)), atol=1e-4, rtol=1e-4)


def test_a_mistral_file_naming_a_window_slides_as_the_mistral_it_came_from(tmp_path):
    """llama.cpp's converter writes a mistral as a llama file without its window (llama.cpp then
    attends to everything); a file whose metadata names a window loads as mistral with it."""
    torch.manual_seed(7)
    theirs = hf_model("mistral")  # a window of WINDOW on every layer
    folder = save_checkpoint(theirs, tmp_path / "mistral")
    plain = load_model(write_gguf(folder, tmp_path / "plain.gguf"))
    assert (plain.config.model_type, plain.config.sliding_window) == ("llama", None)
    window = {"llama.attention.sliding_window": (WINDOW, gguf.GGUFValueType.UINT32)}
    ours = load_model(write_gguf(folder, tmp_path / "window.gguf", fields=window))
    assert (ours.config.model_type, ours.config.sliding_window) == ("mistral", WINDOW)
    torch.testing.assert_close(_logits(ours), _logits(theirs), atol=1e-4, rtol=1e-4)
    assert _greedy(ours) == _greedy(theirs)


def _meta(arch: str, layers: int = 2, **fields) -> dict:
    """The metadata of a file of `arch` (hidden 64, 4 heads of 16), with `fields` (keys after
    `{arch}.`) added."""
    meta = {"general.architecture": arch, "tokenizer.ggml.tokens": ["a"] * 8}
    sizes = {"block_count": layers, "embedding_length": 64, "feed_forward_length": 128,
             "attention.head_count": 4, "attention.head_count_kv": 2, "attention.key_length": 16}
    meta.update({f"{arch}.{key}": value for key, value in {**sizes, **fields}.items()})
    return meta


def _config(meta: dict) -> ModelConfig:
    return ModelConfig.from_dict(config_dict(meta, set(), "m.gguf"))


def test_what_the_converter_leaves_out_reads_as_llama_cpp_reads_it():
    gemma2 = _config(_meta("gemma2", layers=4))  # no window, no soft-caps named
    assert gemma2.sliding_window == 4096 and gemma2.layer_types[:2] == (SLIDING_ATTENTION, FULL_ATTENTION)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap) == (50.0, 30.0)
    assert gemma2.attention_scale == 16**-0.5
    wide = _meta("gemma3", layers=62, embedding_length=96, **{"attention.sliding_window": 8})
    assert _config(wide).attention_scale == (96 // 4) ** -0.5  # the 27B's hidden / heads
    gemma3 = _config(_meta("gemma3", layers=7, **{"attention.sliding_window": 8, "rope.freq_base": 1e6,
                                                  "rope.scaling.type": "linear", "rope.scaling.factor": 8.0}))
    assert gemma3.layer_types == (*_GEMMA3_LAYERS, SLIDING_ATTENTION)
    assert (gemma3.rope_theta, gemma3.rope_scaling.factor, gemma3.local_rope_theta) == (1e6, 8.0, 1e4)
    assert _config(_meta("gemma3", **{"rope.freq_base_swa": 5e4})).local_rope_theta == 5e4
    assert _config(_meta("gemma3")).layer_types == (FULL_ATTENTION,) * 2  # no window named: none
    assert _config(_meta("phi3", **{"attention.sliding_window": 0})).sliding_window is None


def test_a_window_pattern_in_the_file_is_followed_and_a_bad_one_named():
    every = _meta("olmo2", layers=3, **{"attention.sliding_window": 8,
                                          "attention.sliding_window_pattern": np.array([True, False, True])})
    assert _config(every).layer_types == (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION)
    period = _meta("gemma2", layers=3, **{"attention.sliding_window_pattern": 3})
    assert _config(period).layer_types == (SLIDING_ATTENTION, SLIDING_ATTENTION, FULL_ATTENTION)
    short = _meta("gemma3", layers=3, **{"attention.sliding_window": 8,
                                         "attention.sliding_window_pattern": np.array([True])})
    with pytest.raises(CheckpointError, match="sliding_window_pattern must be a positive period or 3 bools"):
        _config(short)
    with pytest.raises(CheckpointError, match="sliding_window must be a whole number"):
        _config(_meta("phi3", **{"attention.sliding_window": "4"}))


def test_an_unknown_tensor_is_still_refused_by_name(families, tmp_path):
    folder, _ = families["gemma3_text"]
    extra = {"blk.0.attn_sinks.weight": np.zeros(4, np.float32)}
    with pytest.raises(CheckpointError, match="tensor 'blk.0.attn_sinks.weight' is not one kvcache knows"):
        load_model(write_gguf(folder, tmp_path / "sinks.gguf", extra=extra))
    folder, _ = families["gemma"]  # a gemma2 norm in a gemma file: not gemma's
    extra = {"blk.0.post_attention_norm.weight": np.ones(64, np.float32)}
    with pytest.raises(CheckpointError, match="tensor 'blk.0.post_attention_norm.weight' is not one"):
        load_model(write_gguf(folder, tmp_path / "norm.gguf", extra=extra))


def test_rope_tables_and_partial_rotation_are_refused_by_name(families, tmp_path):
    folder, _ = families["phi3"]
    longrope = {f"rope_factors_{kind}.weight": np.ones(8, np.float32) for kind in ("long", "short")}
    with pytest.raises(CheckpointError, match="RoPE scaling rope_factors_long.weight and rope_factors_short"):
        load_model(write_gguf(folder, tmp_path / "long.gguf", extra=longrope))
    partial = {"phi3.rope.dimension_count": (8, gguf.GGUFValueType.UINT32)}
    with pytest.raises(CheckpointError, match=r"8 of each head's 16 dimensions \(rope.dimension_count\)"):
        load_model(write_gguf(folder, tmp_path / "partial.gguf", fields=partial))
