"""GGUF files for the tests, written here with the `gguf` package from a checkpoint folder made by
`tiny_models.save_checkpoint`, the way llama.cpp's converter (convert_hf_to_gguf.py) lays them out:
tensor names from the `gguf` package's own name map of the architecture, llama (and mistral, which
converts to llama) query/key rows with each head's rotary pairs interleaved, gemma's norm weights
with its 1 added, phi3's projections fused as stored, gemma3's embedding cut to the tokenizer's
tokens, each family's metadata keys, 1-D tensors in F32, matrices in the asked type, the
tokenizer's vocabulary (padded to the model's vocabulary with unused tokens), merges and control
tokens in the metadata, or a sentencepiece vocabulary given as `SentencePieceVocab`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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


# model_type -> the GGUF architecture llama.cpp's converter writes
ARCHES = {"gemma3_text": "gemma3", "mistral": "llama"}
_GEMMAS = ("gemma", "gemma2", "gemma3")


def gguf_name(name: str, arch: str = "llama", layers: int = 1) -> str:
    """The GGUF name of checkpoint tensor `name` in a file of `arch`: the `gguf` package's name map
    (as the converter's map_tensor_name), else the llama names (for files deliberately labelled
    with an architecture whose map lacks them)."""
    import gguf

    stem, _, suffix = name.rpartition(".")
    kind = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}.get(arch)
    mapped = gguf.get_tensor_name_map(kind, layers).get_name(stem) if kind is not None else None
    if mapped is not None:
        return f"{mapped}.{suffix}"
    if name in _TOP:
        return _TOP[name]
    _, _, index, rest = name.split(".", 3)
    return f"blk.{index}.{_LAYER[rest]}"


def quantize_blocks(values: np.ndarray, kind: str) -> np.ndarray:
    """values (rows, columns) float32 as ggml blocks of `kind` (rows, row bytes) uint8: the `gguf`
    package's quantizer where it has one; the K-quants (which it only dequantizes) by a plain
    min/max rounding here, laid out as the format is (not llama.cpp's search for the best scales:
    the tests need valid blocks, not the smallest error)."""
    import gguf

    if kind not in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"):
        return gguf.quants.quantize(values, gguf.GGMLQuantizationType[kind])
    rows = values.shape[0]
    blocks = values.astype(np.float32).reshape(-1, 256)
    if kind in ("Q2_K", "Q3_K"):
        packed = _q2_k(blocks) if kind == "Q2_K" else _q3_k(blocks)
    else:
        packed = _q6_k(blocks) if kind == "Q6_K" else _q45_k(blocks, 31 if kind == "Q5_K" else 15)
    return packed.reshape(rows, -1)


def _two_bits(q: np.ndarray) -> np.ndarray:
    """(n, 256) values 0..3 as Q2_K's and Q3_K's 64 bytes: value 128h + 32j + k is bits 2j, 2j + 1
    of byte 32h + k."""
    parts = q.reshape(-1, 2, 4, 32).astype(np.uint8)
    return np.bitwise_or.reduce(parts << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2).reshape(-1, 64)


def _q2_k(blocks: np.ndarray) -> np.ndarray:
    """Q2_K blocks of (n, 256) values: 16 bytes of 4-bit scales (low nibble) and minimums (high),
    64 bytes of 2-bit q, d, dmin; value = d·scale·q - dmin·min over each 16 values."""
    groups = blocks.reshape(-1, 16, 16)
    low = np.minimum(groups.min(-1), 0.0)
    steps, mins = (groups.max(-1) - low) / 3, -low
    d = (np.maximum(steps.max(-1), 1e-8) / 15).astype(np.float16).astype(np.float32)
    dmin = (np.maximum(mins.max(-1), 1e-8) / 15).astype(np.float16).astype(np.float32)
    scale = np.clip(np.rint(steps / d[:, None]), 1, 15).astype(np.uint8)
    minimum = np.clip(np.rint(mins / dmin[:, None]), 0, 15).astype(np.uint8)
    step = (d[:, None] * scale)[..., None]
    q = np.clip(np.rint((groups + (dmin[:, None] * minimum)[..., None]) / step), 0, 3).reshape(-1, 256)
    halves = [half.astype(np.float16).view(np.uint8).reshape(-1, 2) for half in (d, dmin)]
    return np.concatenate([scale | (minimum << 4), _two_bits(q), *halves], axis=1)


def _q3_k(blocks: np.ndarray) -> np.ndarray:
    """Q3_K blocks of (n, 256) values: 32 bytes of high bits (bit i of byte k: value 32i + k's),
    64 bytes of low 2 bits, 12 bytes of 6-bit scales (stored + 32), d; value = d·scale·(q - 4)
    over each 16 values, q = low | high << 2; every other block with d and its scales negative."""
    groups = blocks.reshape(-1, 16, 16)
    steps = np.abs(groups).max(-1) / 4
    sign = np.where(np.arange(len(groups)) % 2 == 1, -1.0, 1.0).astype(np.float32)
    d = (sign * np.maximum(steps.max(-1), 1e-8) / 31).astype(np.float16).astype(np.float32)
    scale = (sign[:, None] * np.clip(np.rint(np.abs(steps / d[:, None])), 1, 31)).astype(np.int8)
    step = (d[:, None] * scale)[..., None]
    q = (np.clip(np.rint(groups / step), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    high = np.bitwise_or.reduce((q >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[:, None], axis=1)
    stored = (scale + 32).astype(np.uint8)  # (n, 16), 6 bits each
    low = (stored[:, :8] & 15) | ((stored[:, 8:] & 15) << 4)
    tops = stored >> 4  # (n, 16): scale j's top 2 bits at byte 8 + j % 4, bits 2·(j // 4)
    top = np.bitwise_or.reduce(tops.reshape(-1, 4, 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=1)
    d_bytes = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([high, _two_bits(q & 3), low, top, d_bytes], axis=1)


def _q45_k(blocks: np.ndarray, top: int) -> np.ndarray:
    """Q4_K (top 15) or Q5_K (top 31) blocks of (n, 256) values: d, dmin, 12 bytes of 6-bit scales
    and minimums, (Q5_K) 32 bytes of fifth bits, 128 bytes of nibbles."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    steps, mins = (sub.max(-1) - low) / top, -low
    d = np.maximum(steps.max(-1), 1e-8) / 63
    dmin = np.maximum(mins.max(-1), 1e-8) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    scale = np.clip(np.rint(steps / d[:, None]), 1, 63).astype(np.uint8)
    minimum = np.clip(np.rint(mins / dmin[:, None]), 0, 63).astype(np.uint8)
    step = (d[:, None] * scale)[..., None]
    q = np.clip(np.rint((sub + (dmin[:, None] * minimum)[..., None]) / step), 0, top).astype(np.uint8)
    scales = np.concatenate([
        (scale[:, :4] & 63) | ((scale[:, 4:] >> 4) << 6),
        (minimum[:, :4] & 63) | ((minimum[:, 4:] >> 4) << 6),
        (scale[:, 4:] & 15) | ((minimum[:, 4:] & 15) << 4),
    ], axis=1)
    nibbles = (q[:, 0::2] & 15) | ((q[:, 1::2] & 15) << 4)  # (n, 4, 32): sub-blocks 2c, 2c + 1
    parts = [d.astype(np.float16).view(np.uint8).reshape(-1, 2),
             dmin.astype(np.float16).view(np.uint8).reshape(-1, 2), scales]
    if top == 31:
        parts.append(np.bitwise_or.reduce((q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None],
                                          axis=1))
    return np.concatenate([*parts, nibbles.reshape(-1, 128)], axis=1)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K blocks of (n, 256) values: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8
    scales (one per 16 values), d; every other block with d and its scales negative, as
    llama.cpp's own files mostly have them."""
    groups = blocks.reshape(-1, 16, 16)
    steps = np.abs(groups).max(-1) / 31
    sign = np.where(np.arange(len(groups)) % 2 == 1, -1.0, 1.0).astype(np.float32)
    d = (sign * np.maximum(steps.max(-1), 1e-8) / 127).astype(np.float16).astype(np.float32)
    scale = (sign[:, None] * np.clip(np.rint(np.abs(steps / d[:, None])), 1, 127)).astype(np.int8)
    step = (d[:, None] * scale)[..., None]
    q = (np.clip(np.rint(groups / step), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # half, t, k
    low = np.empty((len(blocks), 2, 64), np.uint8)
    low[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)
    low[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)
    high = np.bitwise_or.reduce((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)
    return np.concatenate([low.reshape(-1, 128), high.reshape(-1, 64), scale.view(np.uint8),
                           d.astype(np.float16).view(np.uint8).reshape(-1, 2)], axis=1)


def interleave(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's permutation: per head, the rows of the two rotary halves interleaved pairwise."""
    rows = weight.shape[0]
    paired = weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
    return paired.swapaxes(1, 2).reshape(weight.shape)


@dataclass(frozen=True)
class SentencePieceVocab:
    """A sentencepiece tokenizer as llama.cpp's converter writes one (tokenizer.ggml.model "llama"):
    pieces, scores and token types (gguf.TokenType values), special ids, the flags (None: the key
    is not written) and a chat template."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos: int = 1
    eos: int = 2
    unknown: int = 0
    add_space_prefix: bool | None = True
    add_bos: bool | None = True
    add_eos: bool | None = False
    chat_template: str | None = None


def write_gguf(folder: Path, path: Path, *, tensor_type: str = "F32", pre: str = "gpt-2",
               arch: str | None = None, fields: dict | None = None, extra: dict | None = None,
               sentencepiece: SentencePieceVocab | None = None) -> Path:
    """Convert the checkpoint in `folder` to the GGUF file `path`; tensor_type: F32, F16 or a block
    format (`quantize_blocks`; the K-quants need columns in multiples of 256); arch: the file's
    architecture (default: the one llama.cpp's converter writes for the checkpoint's model_type);
    `fields`: metadata key -> (value, gguf.GGUFValueType[, element type of an array]) written in
    place of the converter's (None: the key left out); `extra`: GGUF name -> float32 array,
    tensors the converter does not write, added as they are; `sentencepiece`: the tokenizer
    written in place of the folder's (the checkpoint's vocab_size its token count)."""
    import gguf

    config = json.loads((folder / "config.json").read_text())
    arch = arch or ARCHES.get(config["model_type"], config["model_type"])
    writer = gguf.GGUFWriter(str(path), arch)
    _write_geometry(writer, config, arch)
    _write_family_fields(writer, config, arch)
    if sentencepiece is None:
        _write_tokenizer(writer, folder, config, pre)
    else:
        _write_sentencepiece(writer, sentencepiece)
    rows = None if sentencepiece is None else len(sentencepiece.tokens)
    _write_tensors(writer, folder, config, arch, tensor_type, rows)
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value)
    for key, spec in (fields or {}).items():
        if spec is None:
            writer.kv_data[0].pop(key, None)
        else:
            writer.kv_data[0][key] = gguf.GGUFValue(*spec)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_geometry(writer, config: dict, arch: str) -> None:
    """The sizes every converter writes (gemma's omits the RoPE base, phi3's the key length)."""
    heads = config["num_attention_heads"]
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    theta = config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 1e4))
    if arch not in ("gemma", "gemma3"):  # (gemma3's: the full layers', `_write_family_fields`)
        writer.add_rope_freq_base(theta)
    writer.add_vocab_size(config["vocab_size"])
    if arch != "phi3":
        writer.add_key_length(config.get("head_dim") or config["hidden_size"] // heads)
        writer.add_value_length(config.get("head_dim") or config["hidden_size"] // heads)


def _write_family_fields(writer, config: dict, arch: str) -> None:
    """What each family's converter class adds: the rotated dimensions (llama, phi3), windows,
    soft-caps, gemma3's full layers' RoPE base and linear scaling, phi3's original context."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config["original_max_position_embeddings"])
        writer.add_sliding_window(config.get("sliding_window") or 0)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    if arch == "gemma3":
        full = config["rope_parameters"]["full_attention"]
        writer.add_rope_freq_base(full["rope_theta"])
        if config.get("final_logit_softcapping"):
            writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
        if full.get("rope_type") == "linear":  # the full layers' only
            import gguf

            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(full["factor"])


def _write_tokenizer(writer, folder: Path, config: dict, pre: str) -> None:
    """The byte-level BPE vocabulary (padded to vocab_size with unused tokens), merges, special
    ids and the chat template."""
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


def _write_sentencepiece(writer, vocab: SentencePieceVocab) -> None:
    """The keys llama.cpp's converter writes for a sentencepiece vocabulary."""
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    writer.add_bos_token_id(vocab.bos)
    writer.add_eos_token_id(vocab.eos)
    writer.add_unk_token_id(vocab.unknown)
    for value, add in ((vocab.add_space_prefix, writer.add_add_space_prefix),
                       (vocab.add_bos, writer.add_add_bos_token), (vocab.add_eos, writer.add_add_eos_token),
                       (vocab.chat_template, writer.add_chat_template)):
        if value is not None:
            add(value)


def converted_tensors(folder: Path, config: dict, arch: str,
                      rows: int | None = None) -> dict[str, np.ndarray]:
    """The checkpoint's tensors (GGUF names, float32) as llama.cpp's converter changes them: a tied
    head dropped, llama's q/k rows interleaved, gemma's norms plus 1, gemma3's embedding cut to
    the tokenizer's tokens (`rows`, else the folder tokenizer's vocabulary plus its added tokens)."""
    from safetensors.numpy import load_file

    tensors = load_file(str(folder / "model.safetensors"))
    if config.get("tie_word_embeddings") or arch in ("gemma", "gemma2"):
        tensors.pop("lm_head.weight", None)
    heads = {"q_proj.weight": config["num_attention_heads"], "k_proj.weight": config["num_key_value_heads"]}
    out = {}
    for name, value in tensors.items():
        value = value.astype(np.float32)
        if arch == "llama" and name.endswith(tuple(heads)):
            value = interleave(value, heads[name.rpartition("self_attn.")[2]])
        if arch in _GEMMAS and name.endswith("norm.weight"):
            value = value + np.float32(1)
        if arch == "gemma3" and name == "model.embed_tokens.weight":
            if rows is None:
                tokenizer = json.loads((folder / "tokenizer.json").read_text())
                rows = len(tokenizer["model"]["vocab"]) + len(tokenizer["added_tokens"])
            value = value[:rows]
        out[gguf_name(name, arch, config["num_hidden_layers"])] = value
    return out


def _write_tensors(writer, folder: Path, config: dict, arch: str, tensor_type: str, rows: int | None) -> None:
    import gguf

    for name, value in converted_tensors(folder, config, arch, rows).items():
        if value.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(name, value)
        elif tensor_type == "F16":
            writer.add_tensor(name, value.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[tensor_type]
            writer.add_tensor(name, quantize_blocks(value, tensor_type), raw_dtype=kind)


def close_to_the_float_path(stored: torch.Tensor, exact: torch.Tensor) -> None:
    """The tolerance the stored-block path keeps to the dequantized float32 path (its activations
    rounded to 8 bits a value, as llama.cpp's are): the KL divergence of its next-token
    distribution from the float path's at most 0.02 nats on average over positions and 0.1 at any
    (SmolLM2's chat prompt: 0.007 and 0.04; random tiny models: under 0.003 and 0.008), and the
    logits not equal (the activations are quantized)."""
    assert stored.shape == exact.shape
    exact_log, stored_log = (torch.log_softmax(t.double(), dim=-1) for t in (exact, stored))
    divergence = (exact_log.exp() * (exact_log - stored_log)).sum(dim=-1)
    assert divergence.mean() <= 0.02 and divergence.max() <= 0.1, divergence
    assert not torch.equal(stored, exact)
