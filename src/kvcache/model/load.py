"""Strict loading of a local Hugging Face checkpoint folder, or a GGUF file, into `LlamaForCausalLM`.

Reads config.json, then the safetensors headers (single file or shards with their index),
checks every tensor's name and shape against the model before reading any data, and only then
builds the model on the meta device and assigns the loaded tensors name for name. Nothing is
downloaded: a path that is not a local folder or GGUF file is an error. A GGUF file is read
through `kvcache.model.gguf_file` with the same checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvcache.defaults import is_gguf, resolve_model_dir
from kvcache.files import read_json_object
from kvcache.model import gguf_file
from kvcache.model.config import NORM_PLACEMENTS, ModelConfig
from kvcache.model.errors import CheckpointError
from kvcache.model.gguf_file import open_gguf
from kvcache.model.heap import release_freed_memory
from kvcache.model.llama import LlamaForCausalLM
from kvcache.model.quantized import (
    ACTIVATIONS,
    BlockWeight,
    QuantizedEmbedding,
    QuantizedLinear,
    read_q8_activations,
    stored_summary,
)
from kvcache.model.safetensors_read import header_entry, read_header, read_tensors

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"
# old checkpoints sometimes carry RoPE tables; they are derived from the config, never loaded
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)

#: the dtype of a GGUF model's tensors not kept as blocks, and so the model's dtype (and its KV
#: pool's) when it is loaded without a dtype
GGUF_DTYPE = torch.float32
EMBEDDING = "model.embed_tokens.weight"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    """A torch dtype from a dtype, a name like "bfloat16", or None (keep the stored dtype)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; expected one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def checkpoint_folder(path: str | Path) -> Path:
    """The folder as a Path, or a CheckpointError saying why it is not a usable local folder."""
    folder = Path(path).expanduser()
    if not folder.exists():
        looks_like_hub_id = str(path).count("/") == 1 and not str(path).startswith((".", "/", "~"))
        hint = (
            f"; {path} looks like a Hugging Face hub id: kvcache reads from disk only, so download "
            "it first (e.g. with the huggingface_hub package's snapshot_download) and pass that folder"
            if looks_like_hub_id else ""
        )
        raise CheckpointError(f"no such file or folder: {str(path)!r}{hint}")
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} is a file but not a GGUF file (it does not start with the GGUF magic); "
            "pass a GGUF file or the checkpoint folder that holds config.json and the safetensors"
        )
    return folder


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint must hold, name -> shape (lm_head omitted when tied)."""
    hidden, inner, dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_width, kv_width = config.num_attention_heads * dim, config.num_key_value_heads * dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for norm in NORM_PLACEMENTS[config.norm_placement]:
            shapes[f"{prefix}{norm}_layernorm.weight"] = (hidden,)
        for name, shape in (
            ("q_proj", (q_width, hidden)),
            ("k_proj", (kv_width, hidden)),
            ("v_proj", (kv_width, hidden)),
            ("o_proj", (hidden, q_width)),
        ):
            shapes[f"{prefix}self_attn.{name}.weight"] = shape
        if config.qkv_bias:
            shapes[prefix + "self_attn.q_proj.bias"] = (q_width,)
            shapes[prefix + "self_attn.k_proj.bias"] = (kv_width,)
            shapes[prefix + "self_attn.v_proj.bias"] = (kv_width,)
        if config.o_bias:
            shapes[prefix + "self_attn.o_proj.bias"] = (hidden,)
        if config.qk_norm is not None:
            per_head = config.qk_norm == "head"
            shapes[prefix + "self_attn.q_norm.weight"] = (dim,) if per_head else (q_width,)
            shapes[prefix + "self_attn.k_norm.weight"] = (dim,) if per_head else (kv_width,)
        for name, shape in (
            ("gate_proj", (inner, hidden)),
            ("up_proj", (inner, hidden)),
            ("down_proj", (hidden, inner)),
        ):
            shapes[f"{prefix}mlp.{name}.weight"] = shape
        if config.mlp_bias:
            shapes[prefix + "mlp.gate_proj.bias"] = (inner,)
            shapes[prefix + "mlp.up_proj.bias"] = (inner,)
            shapes[prefix + "mlp.down_proj.bias"] = (hidden,)
    return shapes


# phi3 stores fused projections; the model keeps them apart (one module per projection, as in
# every family), so they are split on loading: stored name -> (module names, split along rows)
_FUSED = {"phi3": {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"),
                   "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}}


def stored_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor as the checkpoint stores it, name -> shape: `expected_shapes`, with a family's
    fused projections (phi3's qkv_proj, gate_up_proj) in place of their parts."""
    shapes = expected_shapes(config)
    for fused, parts in _FUSED.get(config.model_type, {}).items():
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}."
            widths = [shapes.pop(prefix + part) for part in parts]
            shapes[prefix + fused] = (sum(w[0] for w in widths), widths[0][1])
    return shapes


def unfuse(config: ModelConfig, state: dict[str, Any]) -> dict[str, Any]:
    """The state under the model's names: fused projections (a tensor, or a GGUF's kept
    `BlockWeight`) split along their rows into their parts (tensors copied; blocks as views)."""
    fusions = _FUSED.get(config.model_type, {})
    if not fusions:
        return state
    shapes = expected_shapes(config)
    out = {}
    for name, tensor in state.items():
        prefix, _, rest = name.rpartition("model.layers.")[2].partition(".")
        parts = fusions.get(rest)
        if parts is None:
            out[name] = tensor
            continue
        base = f"model.layers.{prefix}."
        start = 0
        for part in parts:
            rows = shapes[base + part][0]
            out[base + part] = _rows(tensor, start, start + rows)
            start += rows
    return out


def _rows(weight: torch.Tensor | BlockWeight, start: int, stop: int) -> torch.Tensor | BlockWeight:
    """Rows start..stop of a weight: a tensor's copied, a BlockWeight's a view of its blocks (each
    row is whole blocks)."""
    if isinstance(weight, BlockWeight):
        return dataclasses.replace(weight, rows=stop - start, blocks=weight.blocks[start:stop])
    return weight[start:stop].clone()


def tensor_files(folder: Path) -> dict[str, Path]:
    """name -> safetensors file holding it, from the single file or the shard index (headers
    read by kvcache's checked reader: a truncated or malformed file is a CheckpointError)."""
    index = folder / SHARD_INDEX
    single = folder / SINGLE_FILE
    if index.is_file():
        weight_map = read_json_object(index, "shard index", CheckpointError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no weight_map")
        located = {name: folder / file for name, file in weight_map.items()}
        for file in sorted(set(located.values())):
            if not file.is_file():
                raise CheckpointError(f"{index} names shard {file.name}, which is missing")
            in_file = set(read_header(file)[0])
            listed = {name for name, where in located.items() if where == file}
            if listed - in_file:
                raise CheckpointError(
                    f"{file.name} lacks tensor(s) the index puts there: {sorted(listed - in_file)[:5]}"
                )
        return located
    if single.is_file():
        return {name: single for name in read_header(single)[0]}
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    if others:
        raise CheckpointError(f"{folder} has {others} but neither {SINGLE_FILE} nor {SHARD_INDEX}")
    pickles = sorted(p.name for pattern in ("*.bin", "*.pt") for p in folder.glob(pattern))
    if pickles:
        raise CheckpointError(
            f"{folder} holds only PyTorch pickle weights ({', '.join(pickles[:3])}); kvcache loads "
            "safetensors only. Convert once with transformers: AutoModelForCausalLM."
            "from_pretrained(DIR).save_pretrained(NEW_DIR, safe_serialization=True)"
        )
    raise CheckpointError(f"{folder} holds no weights ({SINGLE_FILE} or {SHARD_INDEX})")


def _check_tensors(
    expected: dict[str, tuple[int, ...]],
    found: dict[str, tuple[tuple[int, ...], str]],
    what: str,
    described_by: str,
) -> set[str]:
    """The names to load of `found` (name -> (shape, a label naming the tensor and its file)),
    checked against the model's `expected` shapes: a missing, unknown or mis-shaped tensor is a
    CheckpointError naming it. Derived tables and the stored copy of a tied embedding are skipped."""
    wanted = {name: seen for name, seen in found.items() if not name.endswith(_DERIVED_SUFFIXES)}
    if "lm_head.weight" not in expected:
        wanted.pop("lm_head.weight", None)  # a stored copy of the tied embedding is not used
    missing = sorted(set(expected) - set(wanted))
    unexpected = sorted(set(wanted) - set(expected))
    if missing:
        raise CheckpointError(f"{what} lacks {len(missing)} tensor(s) the model needs: {missing[:8]}")
    if unexpected:
        raise CheckpointError(
            f"{what} has {len(unexpected)} tensor(s) the model does not know: {unexpected[:8]}"
        )
    for name, (shape, label) in wanted.items():
        if shape != expected[name]:
            raise CheckpointError(
                f"tensor {label} has shape {shape}, expected {expected[name]} from {described_by}"
            )
    return set(wanted)


def _check_names_and_shapes(config: ModelConfig, located: dict[str, Path]) -> dict[str, Path]:
    """The tensors to load (name -> file), their names and shapes read from the file headers."""
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    for file in sorted(set(located.values())):
        entries, data_start = read_header(file)
        size = file.stat().st_size
        for name, entry in entries.items():
            if located.get(name) == file:
                dtype, shape, _, _ = header_entry(file, name, entry, data_start, size)
                if not dtype.is_floating_point:
                    raise CheckpointError(
                        f"{file.name}: tensor {name} is stored as {dtype}; a checkpoint's weights are "
                        f"float32, float16 or bfloat16"
                    )
                shape = tuple(shape)
                found[name] = (shape, f"{name} in {file.name}")
    names = _check_tensors(stored_shapes(config), found, "checkpoint", "config.json")
    return {name: located[name] for name in names}


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    progress: Callable[[float, str], None] | None = None,
    activations: str = "float32",
) -> LlamaForCausalLM:
    """Load a local checkpoint folder (a family of SUPPORTED_MODEL_TYPES), or a llama.cpp
    GGUF file of one of those families (`gguf_file.FAMILIES`), strictly, in eval mode.

    path: the folder or .gguf file; None loads kvcache's bundled default model (`kvcache.defaults`).
    dtype: None keeps the stored dtype (mixed stored dtypes become the embedding's dtype; a GGUF's
    weights in a `quantized.STORED_KINDS` format stay its mapped blocks, every other tensor is
    dequantized to float32); otherwise every tensor is converted to it (a GGUF's dequantized).
    progress: called as progress(fraction of the tensors read, label) while reading, and with
    (1.0, "done") at the end (a `kvcache.report.progress.ProgressBar` draws it).
    activations: how products with weights kept as blocks read their input: "float32" (exact:
    the dequantized weight's product) or "q8" (rounded to 8 bits as llama.cpp's CPU products
    round them: its arithmetic and speed, an approximation; `quantized.read_q8_activations`);
    "auto": "q8" for a GGUF file loaded without a dtype, else "float32" (the commands' default).
    "q8" needs a GGUF loaded without a dtype (ValueError otherwise).
    """
    if activations not in (*ACTIVATIONS, "auto"):
        raise ValueError(f"activations must be one of {(*ACTIVATIONS, 'auto')}, got {activations!r}")
    if activations == "q8" and dtype is not None:
        raise ValueError(f"activations='q8' reads a GGUF's weights kept as blocks; dtype={dtype} dequantizes "
                         "them all (load it without a dtype)")
    resolved = resolve_model_dir(path)
    explicit = activations != "auto"
    if not explicit:
        activations = "q8" if dtype is None and is_gguf(resolved) else "float32"
    dtype = resolve_dtype(dtype)
    say = progress or (lambda fraction, label: None)
    say(0.0, "reading tensors")
    if is_gguf(resolved):
        config, state, blocks, dequantized = read_gguf_model(
            Path(resolved).expanduser(), say, keep_blocks=dtype is None
        )
        model = _build(config, state, dtype or GGUF_DTYPE, device, blocks)
        if activations == "q8" and not read_q8_activations(model) and explicit:
            raise ValueError(f"activations='q8' reads a GGUF's Q8_0, Q4_0, Q4_1, Q5_0 or Q5_1 weights "
                             f"kept as blocks: {resolved} has none kept (load it without a dtype)")
        model.weights_note = gguf_file.weights_note(stored_summary(model), dequantized)
    else:
        if activations == "q8":
            raise ValueError(f"activations='q8' reads a GGUF file's weights kept as blocks; {resolved} is "
                             "a folder")
        folder = checkpoint_folder(resolved)
        config = ModelConfig.from_file(folder)
        wanted = _check_names_and_shapes(config, tensor_files(folder))
        state: dict[str, torch.Tensor] = {}
        for file in sorted(set(wanted.values())):
            names = {name for name, where in wanted.items() if where == file}
            state.update(read_tensors(file, names))
            say(len(state) / len(wanted), "reading tensors")
        stored = state[EMBEDDING].dtype  # (`held_dtype` reads it from the header)
        model = _build(config, unfuse(config, state), dtype or stored, device)
    say(1.0, "done")
    return model


def held_dtype(path: str | Path | None) -> torch.dtype:
    """The dtype `load_model(path)` holds the model in without a dtype, and so the dtype an
    engine's pool stores keys and values in by default, read without loading a tensor: a GGUF
    file's GGUF_DTYPE, a folder's embedding's stored dtype (from its safetensors header).
    CheckpointError for a folder without weights."""
    resolved = resolve_model_dir(path)
    if is_gguf(resolved):
        return GGUF_DTYPE
    file = tensor_files(checkpoint_folder(resolved)).get(EMBEDDING)
    if file is None:
        raise CheckpointError(f"{resolved} has no {EMBEDDING}")
    header, data_start = read_header(file)
    return header_entry(file, EMBEDDING, header.get(EMBEDDING), data_start, file.stat().st_size)[0]


def read_gguf_model(
    path: Path, progress: Callable[[float, str], None] | None = None, keep_blocks: bool = False
) -> tuple[ModelConfig, dict[str, torch.Tensor], dict[str, BlockWeight], dict[str, int]]:
    """The config, float32 tensors, kept block weights (Hugging Face names) and how many
    quantized tensors of each kind were dequantized, of a GGUF file:
    with keep_blocks, a projection's or the embedding's weight in a `quantized.STORED_KINDS`
    format stays its blocks (mapped from the file; llama's query and key rows permuted in a
    copy), every other tensor is dequantized (gemma's norms less the 1 its converter added);
    phi3's fused projections are split into their parts. Every tensor's name, type and shape is
    checked against the config before any is read. progress(fraction of the tensors read,
    label) after each."""
    source = str(path)
    reader = open_gguf(path)
    meta = gguf_file.metadata(reader)
    family = gguf_file.family_of(meta, source)
    # the config first: a RoPE table it refuses is named as such, not as an unknown tensor
    config = ModelConfig.from_dict(gguf_file.config_dict(meta, {t.name for t in reader.tensors}, source))
    located = gguf_file.located_tensors(reader, family, source)
    stored = stored_shapes(config)  # phi3's fused projections as the file holds them
    found = {name: (gguf_file.tensor_shape(t), f"{t.name} in {path.name}") for name, t in located.items()}
    located = {name: located[name] for name in _check_tensors(stored, found, source, "the file's metadata")}
    heads = config.num_attention_heads, config.num_key_value_heads
    state, blocks, dequantized = {}, {}, {}
    for name, tensor in located.items():
        rows_permuted = gguf_file.permutation_heads(name, family, *heads)
        if keep_blocks and gguf_file.keeps_blocks(name, tensor):
            blocks[name] = gguf_file.block_weight(tensor, stored[name], rows_permuted)
        else:
            shift = gguf_file.norm_shift(name, family)
            state[name] = torch.from_numpy(gguf_file.read_tensor(tensor, stored[name], rows_permuted, shift))
            kind = tensor.tensor_type.name
            if kind not in gguf_file.FLOAT_TYPES:
                dequantized[kind] = dequantized.get(kind, 0) + 1
        if progress is not None:
            progress((len(state) + len(blocks)) / len(located), "reading tensors")
    state, blocks = unfuse(config, state), unfuse(config, blocks)
    return config, state, blocks, dequantized


def _use_blocks(
    model: LlamaForCausalLM, config: ModelConfig, state: dict[str, torch.Tensor],
    blocks: dict[str, BlockWeight],
) -> None:
    """Put a QuantizedLinear or QuantizedEmbedding over each weight in `blocks` in place of its
    module (its bias taken from `state`); a tied lm_head reads the embedding's blocks (a tied
    head over an embedding not kept is tied by `_build`, as a float model's)."""
    for name, weight in blocks.items():
        path = name.removesuffix(".weight")
        parent_name, _, attribute = path.rpartition(".")
        parent = model.get_submodule(parent_name)
        if attribute == "embed_tokens":
            setattr(parent, attribute, QuantizedEmbedding(weight))
        else:
            setattr(parent, attribute, QuantizedLinear(weight, state.pop(path + ".bias", None)))
    embedding = model.model.embed_tokens
    if config.tie_word_embeddings and isinstance(embedding, QuantizedEmbedding):
        model.lm_head = QuantizedLinear(embedding.weight_blocks)


def _build(
    config: ModelConfig, state: dict[str, torch.Tensor], target: torch.dtype, device,
    blocks: dict[str, BlockWeight] | None = None,
) -> LlamaForCausalLM:
    """The model on `device` holding `state` converted to `target`, and `blocks` (weight name ->
    its stored blocks: CPU only) in quantized modules, checked complete."""
    state = {name: tensor.to(device=device, dtype=target) for name, tensor in state.items()}
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    if blocks:
        _use_blocks(model, config, state, blocks)
    for rotary in (model.model.rotary_emb, model.model.local_rotary_emb):
        if rotary is not None:  # built on the CPU, not as meta tensors
            rotary.inv_freq = rotary.inv_freq.to(device)
    model.load_state_dict(state, strict=not (config.tie_word_embeddings or blocks), assign=True)
    del state  # the model holds the tensors now
    if config.tie_word_embeddings and not isinstance(model.model.embed_tokens, QuantizedEmbedding):
        model.lm_head.weight = model.model.embed_tokens.weight
    left_empty = [name for name, param in model.named_parameters() if param.is_meta]
    if left_empty:
        raise CheckpointError(f"tensor(s) not loaded: {left_empty[:8]}")
    release_freed_memory()  # the loader's freed buffers leave resident memory
    return model.eval()
