"""GGUF files for the tests, written here with the `gguf` package from a checkpoint folder made by
`tiny_models.save_checkpoint`, the way llama.cpp's converter lays them out: llama query/key rows
with each head's rotary pairs interleaved, 1-D tensors in F32, matrices in the asked type, the
tokenizer's vocabulary (padded to the model's vocabulary with unused tokens), merges and control
tokens in the metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}"


def interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation: per head, the rows of the two rotary halves interleaved pairwise."""
    rows = weight.shape[0]
    paired = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return paired.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(folder: Path, path: Path, *, tensor_type: str = "F32", pre: str = "gpt-2",
               arch: str | None = None, fields: dict | None = None) -> Path:
    """Convert the checkpoint in `folder` to the GGUF file `path`; tensor_type: F32, F16 or Q8_0;
    `fields`: metadata key -> (value, gguf.GGUFValueType[, element type of an array]) written in
    place of the converter's."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = arch or config["model_type"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 1e4))
    writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
    writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)

    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * config["vocab_size"]
    for token, index in vocab.items():
        tokens[index] = token
    special = {added["content"] for added in tokenizer["added_tokens"] if added["special"]}
    types = []
    for index, token in enumerate(tokens):
        if token is None:
            tokens[index] = f"<unused{index}>"
            types.append(5)
        else:
            types.append(3 if token in special else 1)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    writer.add_bos_token_id(vocab[settings["bos_token"]])
    writer.add_eos_token_id(vocab[settings["eos_token"]])
    from kvcache import load_tokenizer

    bos = vocab[settings["bos_token"]]
    writer.add_add_bos_token(load_tokenizer(folder).encode("a")[:1] == [bos])  # as the folder's does
    writer.add_chat_template(settings["chat_template"])

    tensors = load_file(str(folder / "model.safetensors"))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith("q_proj.weight"):
            value = interleave(value, heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            value = interleave(value, kv_heads)
        if value.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(gguf_name(name), value)
        elif tensor_type == "F16":
            writer.add_tensor(gguf_name(name), value.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[tensor_type]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(value, kind), raw_dtype=kind)
    for key, spec in (fields or {}).items():
        writer.kv_data[0][key] = gguf.GGUFValue(*spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
