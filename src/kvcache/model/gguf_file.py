"""Reading a llama.cpp GGUF file: its metadata as a config.json-style dict, and its tensors under
Hugging Face's names, dequantized to float32 by the `gguf` package (the format's own library);
the container itself is parsed by kvcache's bounded reader, `kvcache.model.gguf_reader`. The file
is data: nothing in it is executed, and every tensor's name, type and shape is checked against
the model its metadata describes before any tensor is dequantized.

Each GGUF architecture is one `Family` in `FAMILIES`: the model_type it loads as, its tensors'
names, and what llama.cpp's converter changed on the way in, undone here so the weights equal the
checkpoint's they were converted from: llama query and key rows have each head's rotary pairs
interleaved (llama.cpp's RoPE rotates adjacent pairs; Hugging Face's the two halves); gemma's
RMSNorm weights are stored with the 1 its norms add already added; phi3's fused qkv and
gate-and-up projections stay fused (the loader splits them). What the converter leaves out, the
metadata's defaults are llama.cpp's: gemma2 and gemma3 slide every layer but every second or
sixth, gemma3's sliding layers rotate at base 10000 unscaled, and their queries scale by
1/sqrt(head_dim) (by 1/sqrt(hidden/heads) at the layer count llama.cpp reads as the 27B models).
A mistral checkpoint converts to a llama file (its window, when the file names one, kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.geometry import FULL_ATTENTION, SIZE_LIMITS, SLIDING_ATTENTION
from kvcache.model.errors import CheckpointError
from kvcache.model.gguf_reader import GGUFFile, read_gguf

# tensor types read: the float ones and the quantized ones the gguf package dequantizes
FLOAT_TYPES = ("F32", "F16", "BF16")
READABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
                  "Q5_K", "Q6_K")

# per-layer tensor names (after "blk.N."): GGUF -> Hugging Face (after "model.layers.N.")
_PROJECTIONS = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_QK_NORMS = {"attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}
_PRE_NORMS = {"attn_norm.weight": "input_layernorm.weight",
              "ffn_norm.weight": "post_attention_layernorm.weight"}
_POST_NORMS = {"post_attention_norm.weight": "post_attention_layernorm.weight",
               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_SANDWICH_NORMS = {"attn_norm.weight": "input_layernorm.weight",
                   "ffn_norm.weight": "pre_feedforward_layernorm.weight", **_POST_NORMS}
# phi3's fused projections, under the names its checkpoints give them (the loader splits them)
_FUSED = {"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
_PHI3_PROJECTIONS = {key: value for key, value in _PROJECTIONS.items()
                     if not key.startswith(("attn_q.", "attn_k.", "attn_v.", "ffn_gate."))}
# frequency tables of RoPE scalings kvcache does not read (llama3's, phi3's longrope)
_ROPE_TABLES = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_MODEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class Family:
    """How llama.cpp lays out one GGUF architecture, and what reading it undoes."""

    model_type: str
    layer_names: dict[str, str]  # per-layer GGUF name -> Hugging Face name
    permuted: bool = False  # query/key rows interleaved per head (the llama converter's)
    norm_shift: float = 0.0  # added to every RMSNorm weight by the converter (gemma: its 1)
    # with a window: every full_every-th layer attends to everything (llama.cpp's swa pattern),
    # the others slide; None: every layer slides
    full_every: int | None = None
    default_window: int | None = None  # the window llama.cpp assumes when the file names none
    softcaps: tuple[str, ...] = ()  # soft-capping keys read (`{arch}.KEY`, config.json's name)
    # gemma2/3: queries scale by 1/sqrt(head_dim), or by 1/sqrt(hidden/heads) at this layer count
    # (the one llama.cpp reads as the 27B model's); None: the default 1/sqrt(head_dim)
    wide_scale_layers: int | None = None
    two_rope_bases: bool = False  # gemma3: sliding layers at `rope.freq_base_swa` (10000), unscaled


_LLAMA_LAYOUT = {**_PROJECTIONS, **_PRE_NORMS, **_QK_NORMS}
_GEMMA2 = dict(norm_shift=1.0, full_every=2, default_window=4096, wide_scale_layers=46,
               softcaps=("attn_logit_softcapping", "final_logit_softcapping"))
_GEMMA3 = dict(norm_shift=1.0, full_every=6, wide_scale_layers=62,
               softcaps=("final_logit_softcapping",), two_rope_bases=True)
#: GGUF architecture -> how it loads
FAMILIES = {
    "llama": Family("llama", _LLAMA_LAYOUT, permuted=True),
    "qwen2": Family("qwen2", _LLAMA_LAYOUT),
    "qwen3": Family("qwen3", _LLAMA_LAYOUT),
    "gemma": Family("gemma", {**_PROJECTIONS, **_PRE_NORMS}, norm_shift=1.0),
    "gemma2": Family("gemma2", {**_PROJECTIONS, **_SANDWICH_NORMS}, **_GEMMA2),
    "gemma3": Family("gemma3_text", {**_PROJECTIONS, **_SANDWICH_NORMS, **_QK_NORMS}, **_GEMMA3),
    "phi3": Family("phi3", {**_PHI3_PROJECTIONS, **_FUSED, **_PRE_NORMS}),
    "olmo2": Family("olmo2", {**_PROJECTIONS, **_POST_NORMS, **_QK_NORMS}),
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


def family_of(meta: dict[str, Any], source: str) -> Family:
    """The file's `Family`; CheckpointError naming an architecture kvcache does not read."""
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise CheckpointError(
            f"{source}: GGUF architecture {arch!r} is not supported; kvcache reads GGUF files of "
            f"{sorted(FAMILIES)} (other families load from a Hugging Face checkpoint folder)"
        )
    return FAMILIES[arch]


def config_dict(meta: dict[str, Any], tensor_names: set[str], source: str) -> dict[str, Any]:
    """The config.json the metadata describes (Hugging Face field names), for ModelConfig."""
    family = family_of(meta, source)
    arch = meta["general.architecture"]

    def get(name: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{name}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    raw: dict[str, Any] = {
        "model_type": family.model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "max_position_embeddings": get("context_length", 2048),
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if isinstance(heads, int) and isinstance(hidden, int) and heads > 0:
        raw["head_dim"] = get("attention.key_length", hidden // heads)
    raw.update(_rope_fields(family, get, tensor_names, raw.get("head_dim"), source))
    raw.update(_window_fields(family, get, raw["num_hidden_layers"], source))
    for key in family.softcaps:
        if meta.get(f"{arch}.{key}") is not None:  # else llama.cpp's default, transformers' too
            raw[key] = meta[f"{arch}.{key}"]
    if family.wide_scale_layers is not None and isinstance(raw.get("head_dim"), int):
        wide = raw["num_hidden_layers"] == family.wide_scale_layers
        raw["query_pre_attn_scalar"] = hidden // heads if wide else raw["head_dim"]
    return raw


def _rope_fields(family: Family, get, tensor_names: set[str], head_dim, source: str) -> dict[str, Any]:
    """The config.json RoPE fields of the metadata (gemma3: a set per layer type); a scaling,
    a frequency table or a partial rotation kvcache does not read is refused."""
    kind = get("rope.scaling.type")
    tables = sorted(tensor_names & _ROPE_TABLES)
    if kind not in (None, "none", "linear") or tables:
        raise CheckpointError(
            f"{source}: RoPE scaling {kind or ' and '.join(tables)} in a GGUF is not supported; load the "
            "model's Hugging Face checkpoint folder instead"
        )
    rotated = get("rope.dimension_count")
    if rotated is not None and isinstance(head_dim, int) and rotated != head_dim:
        raise CheckpointError(
            f"{source}: RoPE turns {rotated} of each head's {head_dim} dimensions (rope.dimension_count); "
            "kvcache rotates whole heads only"
        )
    full: dict[str, Any] = {"rope_theta": get("rope.freq_base", 10000.0)}
    if kind == "linear":
        full.update(rope_type="linear", factor=get("rope.scaling.factor"))
    if not family.two_rope_bases:
        return {"rope_theta": full["rope_theta"], "rope_scaling": full if kind == "linear" else None}
    sliding = {"rope_theta": get("rope.freq_base_swa", 10000.0)}  # never scaled (llama.cpp)
    return {"rope_parameters": {FULL_ATTENTION: full, SLIDING_ATTENTION: sliding}}


def _window_fields(family: Family, get, layers, source: str) -> dict[str, Any]:
    """sliding_window and layer_types as the metadata gives them: `attention.sliding_window`
    (0: none) and `attention.sliding_window_pattern` (a period, or a bool per layer: sliding),
    else the family's llama.cpp defaults. A llama file with a window loads as mistral."""
    window = get("attention.sliding_window", family.default_window) or 0
    most = SIZE_LIMITS["num_hidden_layers"]
    if not isinstance(layers, int) or isinstance(layers, bool) or not 0 < layers <= most:
        return {}  # (ModelConfig names the bad block_count, geometry one past its limit, before any list)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise CheckpointError(f"{source}: attention.sliding_window must be a whole number, got {window!r}")
    if not window:
        return {"sliding_window": None, "layer_types": [FULL_ATTENTION] * layers}
    pattern = get("attention.sliding_window_pattern", family.full_every)
    if pattern is None:
        sliding = [True] * layers
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        sliding = [(i + 1) % pattern != 0 for i in range(layers)]  # llama.cpp: i % n < n - 1
    elif isinstance(pattern, np.ndarray) and pattern.dtype == bool and pattern.shape == (layers,):
        sliding = [bool(flag) for flag in pattern]
    else:
        raise CheckpointError(
            f"{source}: attention.sliding_window_pattern must be a positive period or {layers} bools, "
            f"got {pattern!r}"
        )
    fields: dict[str, Any] = {"sliding_window": window,
                              "layer_types": [SLIDING_ATTENTION if s else FULL_ATTENTION for s in sliding]}
    if family.model_type == "llama":
        fields["model_type"] = "mistral"  # the one llama-shaped family whose layers slide
    return fields


def gguf_config(path: str | Path) -> dict[str, Any]:
    """The config.json (Hugging Face field names) that GGUF file `path` describes; no tensor is read."""
    reader = open_gguf(path)
    return config_dict(metadata(reader), {tensor.name for tensor in reader.tensors}, str(path))


def hf_name(name: str, family: Family) -> str | None:
    """The Hugging Face name of a GGUF tensor name in a file of `family`, or None for one kvcache
    does not know."""
    if name in _MODEL_NAMES:
        return _MODEL_NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in family.layer_names:
        return f"model.layers.{int(parts[1])}.{family.layer_names[parts[2]]}"
    return None


def located_tensors(reader, family: Family, source: str) -> dict[str, Any]:
    """Hugging Face name -> the reader's tensor; unknown names and unreadable types refused."""
    out: dict[str, Any] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, family)
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


def read_tensor(tensor, shape: tuple[int, ...], permute_heads: int | None, shift: float = 0.0) -> np.ndarray:
    """The tensor dequantized to a float32 array of `shape`; permute_heads=H undoes llama.cpp's
    rotary-pair interleaving of a query or key weight with H heads; `shift` is subtracted (what
    the converter added: `norm_shift`)."""
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
    values = np.array(values, dtype=np.float32, order="C")  # a copy: never a view of the mapped file
    if shift:
        values -= np.float32(shift)
    return values


def norm_shift(name: str, family: Family) -> float:
    """What the converter added to tensor `name` (Hugging Face name) of a `family` file."""
    return family.norm_shift if name.endswith("norm.weight") else 0.0


def permutation_heads(name: str, family: Family, heads: int, kv_heads: int) -> int | None:
    """How many heads a tensor's rows are permuted over (None: not permuted)."""
    if not family.permuted:
        return None
    if name.endswith("self_attn.q_proj.weight"):
        return heads
    if name.endswith("self_attn.k_proj.weight"):
        return kv_heads
    return None


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
    family = FAMILIES.get(metadata(reader).get("general.architecture"))
    total = 0
    for tensor in reader.tensors:
        name = hf_name(tensor.name, family) if family is not None else None
        if name is not None and keeps_blocks(name, tensor):
            total += tensor.data.nbytes
        else:
            total += 4 * math.prod(tensor.shape)
    return total
