"""Reading a llama.cpp GGUF file: its metadata as a config.json-style dict, and its tensors under
Hugging Face's names, dequantized to float32 by the `gguf` package (the format's own library);
the container itself is parsed by kvcache's bounded reader, `kvcache.model.gguf_reader`. The file
is data: nothing in it is executed, and every tensor's name, type and shape is checked against
the model its metadata describes before any tensor is dequantized.

llama.cpp's converter stores llama query and key weights with each head's rotary pairs
interleaved (its RoPE rotates adjacent pairs; Hugging Face's rotates the two halves); reading
undoes that permutation, so the weights equal the checkpoint's they were converted from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.model.errors import CheckpointError
from kvcache.model.gguf_reader import GGUFFile, read_gguf

# GGUF architecture -> the model_type it is loaded as; the converter permutes q/k for llama only
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED = {"llama"}
# tensor types read: the float ones and the quantized ones the gguf package dequantizes
FLOAT_TYPES = ("F32", "F16", "BF16")
READABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                  "Q5_K", "Q6_K")

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path) -> GGUFFile:
    """The file read by kvcache's bounded reader (`kvcache.model.gguf_reader`): metadata fields and
    tensor records checked, tensor data mapped, nothing dequantized yet."""
    try:
        import gguf  # noqa: F401 (its type tables and dequantizers)
    except ImportError:
        raise CheckpointError(
            f"{path} is a GGUF file; reading it needs the gguf package: pip install gguf"
        ) from None
    return read_gguf(path)


def metadata(reader: GGUFFile) -> dict[str, Any]:
    """Every metadata field of the file, key -> value (string arrays as lists, numeric ones as arrays)."""
    return reader.fields


def config_dict(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """The config.json the metadata describes (Hugging Face field names), for ModelConfig."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported; kvcache reads GGUF files of "
            f"{sorted(ARCHITECTURES)} (other families load from a Hugging Face checkpoint folder)"
        )

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    if get("rope.scaling.type") not in (None, "none", "linear") or "rope_freqs.weight" in tensor_names:
        raise CheckpointError(
            f"{source}: RoPE scaling {get('rope.scaling.type') or 'rope_freqs (llama3)'} in a GGUF is "
            "not supported; load the model's Hugging Face checkpoint folder instead"
        )
    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    raw: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        raw["head_dim"] = get("attention.key_length", hidden // heads)
    if get("rope.scaling.type") == "linear":
        raw["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    return raw


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The config.json (Hugging Face field names) that GGUF file `path` describes; no tensor is read."""
    reader = open_gguf(path)
    return config_dict(metadata(reader), {tensor.name for tensor in reader.tensors}, str(path))


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for one kvcache does not know."""
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
    return None


def located_tensors(reader, source: str) -> dict[str, Any]:
    """Hugging Face name -> the reader's tensor; unknown names and unreadable types refused."""
    out: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise CheckpointError(f"{source}: tensor {tensor.name!r} is not one kvcache knows how to load")
        if tensor.tensor_type.name not in READABLE_TYPES:
            raise CheckpointError(
                f"{source}: tensor {tensor.name} has type {tensor.tensor_type.name}; kvcache reads "
                f"{', '.join(READABLE_TYPES)}"
            )
        out[name] = tensor
    return out


def tensor_shape(tensor) -> tuple[int, ...]:
    """The tensor's shape in torch order (GGUF lists dimensions innermost first)."""
    return tuple(int(extent) for extent in reversed(tensor.shape))


def read_tensor(tensor, shape: tuple[int, ...], permute_heads: int | None) -> np.ndarray:
    """The tensor dequantized to a float32 array of `shape`; permute_heads=H undoes llama.cpp's
    rotary-pair interleaving of a query or key weight with H heads."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data, kind = tensor.data, tensor.tensor_type
    if kind == GGMLQuantizationType.F32:
        values = data.view(np.float32)
    elif kind == GGMLQuantizationType.F16:
        values = data.view(np.float16).astype(np.float32)
    else:  # rows of whole blocks, as the gguf package's dequantizer takes them
        values = dequantize(data.reshape(-1, data.size // math.prod(tensor.shape[1:])), kind)
        values = values.astype(np.float32, copy=False)
    values = values.reshape(shape)
    if permute_heads:
        rows, *rest = values.shape
        # stored: per head, rows (pair j, coordinate c) at 2j + c; Hugging Face's: c·D/2 + j
        values = values.reshape(permute_heads, rows // permute_heads // 2, 2, *rest).swapaxes(1, 2)
        values = values.reshape(rows, *rest)
    return np.array(values, dtype=np.float32, order="C")  # a copy: never a view of the mapped file


def permutation_heads(name: str, arch_permutes: bool, heads: int, kv_heads: int) -> int | None:
    """How many heads a tensor's rows are permuted over (None: not permuted)."""
    if not arch_permutes:
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return heads
    if name.endswith("self_attn.k_proj.weight"):
        return kv_heads
    return None


def permutes(meta: dict[str, Any]) -> bool:
    """Whether this file's converter interleaved the query/key rotary pairs."""
    return meta.get("general.architecture") in _PERMUTED


def keeps_blocks(name: str, tensor) -> bool:
    """Whether a tensor (Hugging Face name) stays its stored blocks when a model keeps them: a
    projection's or the embedding's weight in one of `quantized.STORED_KINDS`."""
    from kvcache.model.quantized import STORED_KINDS

    weight = name.endswith("_proj.weight") or name in ("model.embed_tokens.weight", "lm_head.weight")
    return weight and tensor.tensor_type.name in STORED_KINDS


def block_weight(tensor, shape: tuple[int, int], permute_heads: int | None):
    """The tensor's blocks as a `quantized.BlockWeight` of `shape` (rows, columns): a view of the
    mapped file, or with permute_heads=H a copy with llama.cpp's rotary-pair interleaving of H
    heads undone (each row is whole blocks, so rows move as they are)."""
    from kvcache.model.quantized import BlockWeight

    rows, columns = shape
    weight = BlockWeight(tensor.tensor_type.name, rows, columns, tensor.data.reshape(rows, -1))
    if permute_heads:
        # stored: per head, rows (pair j, coordinate c) at 2j + c; Hugging Face's: c·D/2 + j
        order = np.arange(rows).reshape(permute_heads, rows // permute_heads // 2, 2).swapaxes(1, 2)
        weight = weight.permuted_rows(order.reshape(-1))
    return weight


def weights_note(kept: str | None, dequantized: dict[str, int]) -> str | None:
    """What a start-up line says of a GGUF's weights: those kept as blocks (`kept`) and the
    quantized tensors dequantized to float32 by kind (None when neither)."""
    parts = [kept] if kept else []
    if dequantized:
        listed = ", ".join(f"{kind} ×{count}" for kind, count in sorted(dequantized.items()))
        parts.append(f"dequantized to float32: {listed}")
    return "; ".join(parts) or None


def held_bytes(path) -> int:
    """Bytes of the weights of GGUF file `path` as `load_model(path)` holds them (no dtype):
    kept blocks as stored (`keeps_blocks`), every other tensor as float32; a tied head counted
    once. Reads the tensor records only."""
    reader = open_gguf(path)
    total = 0
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is not None and keeps_blocks(name, tensor):
            total += tensor.data.nbytes
        else:
            total += 4 * math.prod(tensor.shape)
    return total
