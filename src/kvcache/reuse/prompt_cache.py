"""Save a prompt's keys and values to disk and load them back into a PagedCache.

    save_prompt_cache("system.kv", cache, model, row=0)      # a row whose token ids are known
    cache = load_prompt_cache("system.kv", model)             # a new PagedCache holding it in row 0

The file is safetensors (no pickle): tensors `keys.{layer}` and `values.{layer}`, each
(tokens, kv_heads, head_dim) in position order, and string metadata: format and version, the
model's fingerprint, dtype, layers, kv_heads, head_dims, the block size it was saved from, and
the token ids. Loading reads the header only, checks every name, shape and dtype against the
model and the metadata, and refuses a file made for another model or layout with a
`PromptCacheError` before any tensor is allocated. Rows are re-blocked on load, so the
target cache may use another block size than the one recorded.

A row of a cache with a kv_dtype (`PagedCache(kv_dtype="int8")`) is saved as stored, in each
side's row format (`kvcache.cache.paged.formats`: packed rows as their bytes, (tokens, kv_heads,
row bytes), uint8, or int8 for fp8), metadata kv_dtype naming it, and loads only into a cache of
that kv_dtype; every value, packed row's float16 scale and zero must be finite (fp8 codes never
NaN).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from kvcache.cache import CacheConfigError, CacheDtypeError, CacheShapeError, PagedCache, RowState
from kvcache.cache.paged.formats import RowFormat, checked_kv_dtype, row_formats
from kvcache.memory import PAGED_KV_DTYPES
from kvcache.model.fingerprint import model_fingerprint

FORMAT = "kvcache.reuse.prompt_cache"
VERSION = "2"  # 2: the fingerprint hashes every weight byte; a checksum covers ids and tensors
MAX_BLOCK_SIZE = 4096
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                torch.float64: "float64"}
_SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}
_STORED_CODES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.uint8: "U8",
                 torch.int8: "I8"}  # of rows in a kv_dtype's format


class PromptCacheError(ValueError):
    """A prompt cache file that does not fit this model or cache, or is not one at all."""


def _layout(model) -> dict[str, str]:
    config = model.config
    return {
        "dtype": _DTYPE_NAMES.get(model.dtype, str(model.dtype)),
        "layers": str(config.num_hidden_layers),
        "kv_heads": str(config.num_key_value_heads),
        "head_dim": str(config.head_dim),
    }


def _checksum(token_ids: list[int], tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the token ids and every tensor's bytes, in name order (hex)."""
    digest = hashlib.sha256(json.dumps(token_ids).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def save_prompt_cache(path: str | os.PathLike, cache: PagedCache, model, row: int = 0) -> int:
    """Write row `row` of `cache` (keys, values, token ids) to `path`; return the tokens saved.

    The row's token ids must be declared for every position it holds (as `add_sequence`,
    `PrefixCache` and `ChatSession` do), since the ids are what a later prompt is matched on.
    """
    from safetensors.torch import save_file

    try:
        state = cache.row_state(row)
    except CacheShapeError as error:
        raise PromptCacheError(f"cannot save row {row}: {error}") from None
    tokens = len(state.token_ids)
    tensors = {}
    for index, (keys, values) in enumerate(zip(state.keys, state.values)):
        tensors[f"keys.{index}"] = keys.cpu().contiguous()  # (T, H_kv, D)
        tensors[f"values.{index}"] = values.cpu().contiguous()  # (T, H_kv, D_v)
    layout = _layout(model)
    stored = cache.layers[0].formats
    expected = (model.dtype, model.dtype) if stored is None else tuple(side.storage_dtype for side in stored)
    if (tensors["keys.0"].dtype, tensors["values.0"].dtype) != expected:
        raise PromptCacheError(f"the cache stores {tensors['keys.0'].dtype}; the model runs {model.dtype}")
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "model_fingerprint": model_fingerprint(model),
        "model_type": str(model.config.model_type),
        **layout,
        "value_head_dim": str(model.config.head_dim),
        "kv_dtype": cache.kv_dtype or "none",
        "block_size": str(cache.block_size),
        "num_tokens": str(tokens),
        "token_ids": json.dumps(state.token_ids),
        "checksum": _checksum(state.token_ids, tensors),
    }
    save_file(tensors, os.fspath(path), metadata=metadata)
    return tokens


def read_prompt_cache_header(path: str | os.PathLike, model) -> dict:
    """Check the file's header against `model` without reading tensor data; return the metadata
    with token_ids parsed. Raises `PromptCacheError` saying what differs."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise PromptCacheError(f"no prompt cache file at {path}")
    try:
        with safe_open(os.fspath(path), "pt") as handle:
            metadata = dict(handle.metadata() or {})
            shapes = {name: (tuple(handle.get_slice(name).get_shape()), handle.get_slice(name).get_dtype())
                      for name in handle.keys()}
    except Exception as error:  # safetensors raises its own error types for a damaged header
        raise PromptCacheError(f"{path} is not a readable safetensors file: {error}") from None
    if metadata.get("format") != FORMAT:
        raise PromptCacheError(f"{path} is not a kvcache prompt cache (format {metadata.get('format')!r})")
    if metadata.get("version") != VERSION:
        raise PromptCacheError(f"{path} has prompt cache version {metadata.get('version')!r}; "
                               f"this kvcache reads version {VERSION}")
    expected = _layout(model)
    for key, want in expected.items():
        if metadata.get(key) != want:
            raise PromptCacheError(
                f"{path} was saved for {key}={metadata.get(key)}; this model has {key}={want}"
            )
    if metadata.get("model_fingerprint") != model_fingerprint(model):
        raise PromptCacheError(
            f"{path} was saved from another model (fingerprint {metadata.get('model_fingerprint')}, "
            f"this model's is {model_fingerprint(model)}): its keys and values would give wrong answers"
        )
    try:
        tokens = int(metadata["num_tokens"])
        value_dim = int(metadata["value_head_dim"])
        block_size = int(metadata["block_size"])
        token_ids = json.loads(metadata["token_ids"])
    except (KeyError, ValueError) as error:
        raise PromptCacheError(f"{path}: damaged metadata ({error})") from None
    if (not isinstance(token_ids, list) or len(token_ids) != tokens or tokens < 1
            or not all(isinstance(t, int) and 0 <= t < model.config.vocab_size for t in token_ids)):
        raise PromptCacheError(f"{path}: token_ids must be {tokens} ids in [0, {model.config.vocab_size})")
    context = model.config.max_position_embeddings
    if tokens > context or not 1 <= block_size <= MAX_BLOCK_SIZE or value_dim != model.config.head_dim:
        raise PromptCacheError(
            f"{path}: {tokens} tokens (the model's context is {context}), block_size {block_size} "
            f"(1..{MAX_BLOCK_SIZE}), value head dim {value_dim} (the model's is {model.config.head_dim}): "
            f"not a prompt cache of this model"
        )
    kv_dtype = metadata.get("kv_dtype", "none")
    if kv_dtype != "none":
        try:  # its one name ("int8/int8" is "int8"), as a cache says it
            kv_dtype = checked_kv_dtype(kv_dtype)
        except CacheConfigError:
            raise PromptCacheError(f"{path}: kv_dtype {kv_dtype!r} is neither none nor one of "
                                   f"{PAGED_KV_DTYPES} (or a keys/values pair of them)") from None
    want = _expected_tensors(model.config, tokens, kv_dtype, _SAFETENSORS_DTYPES.get(expected["dtype"]))
    if shapes != want:
        wrong = sorted(set(shapes.items()) ^ set(want.items()))[:4]
        raise PromptCacheError(f"{path}: tensors do not match the metadata and model, e.g. {wrong}")
    return {**metadata, "num_tokens": tokens, "block_size": block_size, "token_ids": token_ids,
            "kv_dtype": None if kv_dtype == "none" else kv_dtype}


def _expected_tensors(config, tokens: int, kv_dtype: str, float_code: str | None) -> dict:
    """{name: (shape, safetensors dtype)} of a file of `tokens` tokens of this model: rows
    (tokens, kv_heads, head_dim) of `float_code`, or for a kv_dtype each side in its row format."""
    heads, dim = config.num_key_value_heads, config.head_dim
    sides = [((tokens, heads, dim), float_code)] * 2
    if kv_dtype != "none":
        sides = [((tokens, heads, side.width), _STORED_CODES[side.storage_dtype])
                 for side in row_formats(kv_dtype, dim, dim)]
    want = {}
    for layer in range(config.num_hidden_layers):
        want[f"keys.{layer}"], want[f"values.{layer}"] = sides
    return want


def load_prompt_cache(path: str | os.PathLike, model, cache: PagedCache | None = None, *,
                      num_blocks: int | None = None, block_size: int | None = None) -> PagedCache:
    """Load the saved prompt into a new row of `cache` (or of a new PagedCache of `num_blocks`
    blocks, default room for 2 × the saved tokens + 256, of `block_size` tokens, default the
    file's);
    the row's full blocks are hashed, so prompts that start with these tokens find them.

    Raises `PromptCacheError` for a file made for another model or layout, and
    `OutOfBlocksError` when the cache lacks room; both before anything is allocated or written.
    """
    from safetensors import safe_open

    header = read_prompt_cache_header(path, model)
    tokens, token_ids = header["num_tokens"], header["token_ids"]
    if cache is None:
        size = block_size or header["block_size"]
        cache = PagedCache(num_blocks or -(-(2 * tokens + 256) // size), size, config=model.config,
                           dtype=model.dtype, device=model.device, kv_dtype=header["kv_dtype"])
    elif len(cache.layers) != model.config.num_hidden_layers:
        raise PromptCacheError(
            f"the cache holds {len(cache.layers)} layers; the file holds {model.config.num_hidden_layers}"
        )
    elif cache.kv_dtype != header["kv_dtype"]:
        raise PromptCacheError(f"{path} holds keys and values as kv_dtype {header['kv_dtype']}; the cache "
                               f"stores {cache.kv_dtype}")
    try:
        with safe_open(os.fspath(path), "pt", device="cpu") as handle:
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except Exception as error:  # noqa: BLE001 (safetensors' own errors for damaged data)
        raise PromptCacheError(f"{path}: tensor data cannot be read: {error}") from None
    if header.get("checksum") != _checksum(list(token_ids), tensors):
        raise PromptCacheError(f"{path}: the checksum does not match its token ids and tensors (tampered?)")
    if not _valid(tensors, header["kv_dtype"], model.config.head_dim):
        raise PromptCacheError(f"{path}: holds non-finite keys or values (or scales, fp8 NaN codes or an "
                               f"fp8 row's zero that is not 0)")
    names = range(model.config.num_hidden_layers)
    state = RowState(
        list(token_ids),
        [tensors[f"keys.{layer}"] for layer in names],  # (T, H_kv, D) each
        [tensors[f"values.{layer}"] for layer in names],
    )
    try:
        cache.load_row_state(state)
    except (CacheShapeError, CacheDtypeError) as error:
        raise PromptCacheError(f"{path} does not fit this cache: {error}") from None
    return cache


def _valid(tensors: dict[str, torch.Tensor], kv_dtype: str | None, dim: int) -> bool:
    """Whether a file's keys and values are rows their format writes (`formats`: finite numbers)."""
    if kv_dtype is None:
        return all(bool(torch.isfinite(values).all()) for values in tensors.values())
    formats: tuple[RowFormat, RowFormat] = row_formats(kv_dtype, dim, dim)
    return all(formats[name.startswith("values.")].valid(rows) for name, rows in tensors.items())
