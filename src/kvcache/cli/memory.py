"""`kvcache memory`: KV-cache bytes for a model (-m as every command takes it), a config.json or a
shape, and what fits in a budget; by default in the dtype the model is held in, which serve's pool
stores keys and values in."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.cli._args import positive_int, size_argument
from kvcache.defaults import is_gguf, resolve_model_dir
from kvcache.geometry import SIZE_LIMITS, read_geometry
from kvcache.memory import (
    DTYPE_BITS,
    PACKED_KV_DTYPES,
    KVShape,
    format_bytes,
    kv_part_name,
    max_paged_sequences,
    max_sequences,
    max_tokens,
    paged_blocks_in_budget,
    paged_kv_cache_bytes,
    paged_row_bytes,
    quantized_kv_cache_bytes,
)


def add_parser(parser: argparse.ArgumentParser) -> None:
    shape = parser.add_argument_group("model shape (give -m, or all three numbers)")
    shape.add_argument(
        "-m", "--model", "--config", dest="config",
        help="a checkpoint folder, a GGUF file or a model name such as smollm2, as every command takes "
        "it, or a Hugging Face config.json (--config is the same flag)",
    )
    shape.add_argument("--layers", type=positive_int, help="number of layers")
    shape.add_argument("--kv-heads", type=positive_int, help="key/value heads per layer")
    shape.add_argument("--head-dim", type=positive_int, help="dimension of one head")
    shape.add_argument("--window", type=positive_int, help="sliding window applied to every layer")
    parser.add_argument("--tokens", type=positive_int, required=True, help="tokens per sequence")
    parser.add_argument("--batch", type=positive_int, default=1, help="sequences (default 1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BITS),
                        help="element type of the cache (default: the dtype kvcache holds -m's model in "
                        "without --dtype, which serve's pool stores keys and values in: a GGUF file's "
                        f"float32, a folder's stored dtype; {NO_MODEL_DTYPE} for numbers or a config.json "
                        "alone)")
    parser.add_argument("--budget", type=size_argument,
                        help="memory budget such as 24GiB: report the longest context for --batch "
                             "and the most sequences of --tokens that fit")
    parser.add_argument("--block-size", type=positive_int,
                        help="also account for a paged cache of blocks of this many tokens (whole "
                             "blocks per sequence; with --budget, how many sequences fit)")
    parser.add_argument("--weights", choices=("bfloat16", "float16", "float32", "stored"),
                        help="with -m: count the model's weights, held in this dtype, too "
                             "(with --budget, the cache gets what the weights leave); stored: a GGUF "
                             "file's weights as kvcache holds them loaded without a dtype (kept "
                             "blocks as stored, the rest float32)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    quantized = parser.add_argument_group(
        "quantized cache (--dtype int8, int4 or float8_e4m3fn: QuantizedCache's bytes, scales and "
        "full-precision residual included)")
    quantized.add_argument("--group-size", type=positive_int, default=64, help="default 64")
    quantized.add_argument("--residual-length", type=int, default=128, help="default 128")
    quantized.add_argument("--residual-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                           help="dtype of the residual rows and the scales (the model's; default bfloat16)")


#: the cache's dtype when no weights say the model's: kvcache's own models (the bundled default,
#: every GGUF file) are held in float32
NO_MODEL_DTYPE = "float32"


def _model_dtype(path: str | None) -> str:
    """The dtype `kvcache.model.load.held_dtype` reads for a model that holds weights (a GGUF file,
    a folder with safetensors): the one `load_model` gives it and so serve's pool's; else
    NO_MODEL_DTYPE."""
    if path is None:
        return NO_MODEL_DTYPE
    from kvcache.model.load import SHARD_INDEX, SINGLE_FILE, held_dtype

    weights = [Path(path) / name for name in (SINGLE_FILE, SHARD_INDEX)] if Path(path).is_dir() else []
    if not is_gguf(path) and not any(file.is_file() for file in weights):
        return NO_MODEL_DTYPE
    return str(held_dtype(path)).removeprefix("torch.")


def _read_config(path: str) -> tuple[dict, str]:
    """The config.json at `path` (or in that folder) as a dict, or the config a GGUF file's
    metadata describes; and the name messages give it. Read once, for the shape and the weights."""
    if not Path(path).exists():
        raise ValueError(f"-m {path}: no such file or folder (expected a checkpoint folder, a GGUF file, "
                         "a model name such as smollm2 or a config.json)")
    if is_gguf(path):  # a llama.cpp file: the config its metadata describes
        from kvcache.model.gguf_file import gguf_config

        return gguf_config(path), path
    from kvcache.files import read_json_object

    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"no config.json at {file}")
    return read_json_object(file, "config file", ValueError), str(file)


def _weights_bytes(args: argparse.Namespace, config: dict | None) -> int | None:
    """Bytes of the weights of -m's model in --weights' dtype (None without --weights)."""
    if args.weights is None:
        return None
    if config is None:
        raise ValueError("--weights needs -m (the weights are counted from the model's config)")
    if args.weights == "stored":
        if not is_gguf(args.config):
            raise ValueError(f"--weights stored counts a GGUF file's tensors; -m {args.config} "
                             "is not a GGUF file (give a dtype for a folder's weights)")
        from kvcache.model.gguf_file import held_bytes

        return held_bytes(args.config)
    from kvcache.model.config import ModelConfig
    from kvcache.model.parameters import weight_bytes

    return weight_bytes(ModelConfig.from_dict(config), args.weights)


def _shape(args: argparse.Namespace, config: dict | None, source: str) -> KVShape:
    if config is not None:
        if any(v is not None for v in (args.layers, args.kv_heads, args.head_dim)):
            raise ValueError("give either -m (--config) or --layers/--kv-heads/--head-dim, not both")
        return KVShape.from_geometry(read_geometry(config, source), source)
    missing = [f"--{n}" for n, v in (("layers", args.layers), ("kv-heads", args.kv_heads),
                                     ("head-dim", args.head_dim)) if v is None]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (or give -m)")
    for flag, value, field in (("--layers", args.layers, "num_hidden_layers"),
                               ("--kv-heads", args.kv_heads, "num_key_value_heads"),
                               ("--head-dim", args.head_dim, "head_dim"),
                               ("--window", args.window, "sliding_window")):
        if value is not None and value > SIZE_LIMITS[field]:  # the bounds a config.json is held to
            raise ValueError(f"{flag} {value:,} is past the largest kvcache accepts ({SIZE_LIMITS[field]:,})")
    layer_types = ("sliding_attention",) * args.layers if args.window else None
    return KVShape(args.layers, args.kv_heads, args.head_dim, args.window, layer_types)


_QUANTIZED_BITS = {"int8": 8, "int4": 4, "float8_e4m3fn": "fp8"}


def run(args: argparse.Namespace) -> int:
    try:
        if args.config is not None:  # a name such as smollm2: the file it stands for
            args.config = str(resolve_model_dir(args.config))
        config, source = _read_config(args.config) if args.config else (None, "")
        shape = _shape(args, config, source)
        weights = _weights_bytes(args, config)
        args.dtype = args.dtype or _model_dtype(args.config)
    except ValueError as error:
        print(f"kvcache memory: error: {error}", file=sys.stderr)
        return 2
    args.weights_bytes, args.total_budget = weights, args.budget
    if weights is not None and args.budget is not None:
        if weights >= args.budget:
            print(f"kvcache memory: the weights alone ({format_bytes(weights)} in {args.weights}) fill "
                  f"the budget of {format_bytes(args.budget)}: no room for a cache", file=sys.stderr)
            return 1
        args.budget -= weights  # what the cache may take
    packed = kv_part_name(args.dtype) in PACKED_KV_DTYPES and args.block_size is not None  # packed paged rows
    if (args.dtype in _QUANTIZED_BITS or args.dtype == "float8_e5m2") and not packed:
        return _run_quantized(shape, args)
    total = _exact_bytes(shape, args.tokens, args.batch, args.dtype)
    result = {
        "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
        "sliding_window": shape.sliding_window, "tokens": args.tokens, "batch": args.batch,
        "dtype": args.dtype, "bytes_per_token": 2 * shape.layers * shape.kv_heads * paged_row_bytes(
            shape.head_dim, args.dtype),
        "bytes_per_sequence": _exact_bytes(shape, args.tokens, 1, args.dtype), "bytes": total,
    }
    result.update(_weights_figures(args))
    if args.budget is not None and not packed:
        result["max_tokens_for_batch"] = max_tokens(shape, args.budget, args.batch, args.dtype)
        result["max_sequences_of_tokens"] = max_sequences(shape, args.budget, args.tokens, args.dtype)
    if args.block_size is not None:
        try:
            result.update(_paged(shape, args))
        except ValueError as error:
            print(f"kvcache memory: error: {error}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_exact(shape, result, args, packed)
    return 0


def _print_exact(shape: KVShape, result: dict, args: argparse.Namespace, packed: bool) -> None:
    """`run`'s figures for a cache stored as computed (or in packed paged rows), as text."""
    total = result["bytes"]
    window = f", sliding window {shape.sliding_window}" if shape.sliding_window else ""
    how = " (paged blocks, quantized: each token's kv head one group, its float16 scale and zero " \
          "counted)" if packed else ""
    print(f"KV cache: {shape.layers} layers × {shape.kv_heads} kv heads × {shape.head_dim} "
          f"head dim{window}, {args.dtype}{how}")
    print(f"  per token (all layers growing): {result['bytes_per_token']:,} B "
          f"({format_bytes(result['bytes_per_token'])})")
    print(f"  one sequence of {args.tokens:,} tokens: {result['bytes_per_sequence']:,} B "
          f"({format_bytes(result['bytes_per_sequence'])})")
    print(f"  batch of {args.batch}: {total:,} B ({format_bytes(total)})")
    _print_weights(args)
    if args.budget is not None and not packed:
        longest = result["max_tokens_for_batch"]
        longest_text = "no limit (every layer keeps at most the window)" if longest is None \
            else f"{longest:,} tokens"
        print(f"  in {_budget_text(args)}: longest context for a batch of "
              f"{args.batch}: {longest_text}; sequences of {args.tokens:,} tokens: "
              f"{result['max_sequences_of_tokens']:,}")
    if args.block_size is not None:
        _print_paged(result, args)


def _run_quantized(shape: KVShape, args: argparse.Namespace) -> int:
    """What a QuantizedCache of `shape` holds: packed groups with their scales (and zero points)
    and the full-precision residual, not elements × bits alone."""
    refusal = None
    if args.dtype == "float8_e5m2":
        refusal = "kvcache's fp8 cache stores float8_e4m3fn; float8_e5m2 is not a cache it builds"
    elif shape.sliding_window:
        refusal = "a quantized cache keeps sliding-window layers as full-precision rings: not computed here"
    elif args.residual_length < 0:
        refusal = f"--residual-length must be >= 0, got {args.residual_length}"
    if refusal:
        print(f"kvcache memory: error: {refusal}", file=sys.stderr)
        return 2
    options = dict(bits=_QUANTIZED_BITS[args.dtype], group_size=args.group_size,
                   residual_length=args.residual_length, dtype=args.residual_dtype)

    def held(tokens: int, batch: int) -> int:
        return quantized_kv_cache_bytes(
            shape.layers, shape.kv_heads, tokens, shape.head_dim, batch, **options
        )

    group = args.group_size  # one group packed, nothing in the residual: the cost per token
    packed = quantized_kv_cache_bytes(shape.layers, shape.kv_heads, group, shape.head_dim, 1,
                                      **{**options, "residual_length": 0}) / group
    result = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim,
              "tokens": args.tokens, "batch": args.batch, "dtype": args.dtype, **options,
              "bytes_per_token_packed": packed, "bytes_per_sequence": held(args.tokens, 1),
              "bytes": held(args.tokens, args.batch), **_weights_figures(args)}
    if args.budget is not None:
        low, high = 0, 1 << 40  # the longest context that fits: held() grows with the tokens
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if held(middle, args.batch) <= args.budget else (low, middle - 1)
        result.update(max_tokens_for_batch=low,
                      max_sequences_of_tokens=args.budget // result["bytes_per_sequence"])
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"KV cache: {shape.layers} layers × {shape.kv_heads} kv heads × {shape.head_dim} head dim, "
          f"{args.dtype} (QuantizedCache: groups of {group}, the last {args.residual_length} tokens and "
          f"the scales in {args.residual_dtype})")
    print(f"  per token once packed (scales included): {packed:,.1f} B")
    print(f"  one sequence of {args.tokens:,} tokens: {result['bytes_per_sequence']:,} B "
          f"({format_bytes(result['bytes_per_sequence'])})")
    print(f"  batch of {args.batch}: {result['bytes']:,} B ({format_bytes(result['bytes'])})")
    _print_weights(args)
    if args.budget is not None:
        print(f"  in {_budget_text(args)}: longest context for a batch of {args.batch}: "
              f"{result['max_tokens_for_batch']:,} tokens; sequences of {args.tokens:,} tokens: "
              f"{result['max_sequences_of_tokens']:,}")
    return 0


def _weights_figures(args: argparse.Namespace) -> dict:
    """The budget and weight fields of the JSON result (budget_bytes: the whole budget;
    cache_budget_bytes: what the weights leave for the cache)."""
    figures = {}
    if args.weights_bytes is not None:
        figures.update(weights_dtype=args.weights, weights_bytes=args.weights_bytes)
    if args.budget is not None:
        figures.update(budget_bytes=args.total_budget, cache_budget_bytes=args.budget)
    return figures


def _print_weights(args: argparse.Namespace) -> None:
    if args.weights_bytes is not None:
        stored = args.weights == "stored"
        held = "as stored (kept blocks, the rest float32)" if stored else f"in {args.weights}"
        print(f"  weights {held}: {args.weights_bytes:,} B ({format_bytes(args.weights_bytes)})")


def _budget_text(args: argparse.Namespace) -> str:
    if args.weights_bytes is None:
        return f"a budget of {format_bytes(args.budget)}"
    return (f"the {format_bytes(args.budget)} a budget of {format_bytes(args.total_budget)} leaves "
            f"after the weights")


def _paged(shape: KVShape, args: argparse.Namespace) -> dict:
    """Paged figures: whole blocks per sequence, and sequences that fit in the budget."""
    per_sequence = paged_kv_cache_bytes(shape, args.tokens, args.block_size, 1, args.dtype)
    figures = {
        "block_size": args.block_size,
        "paged_bytes_per_sequence": per_sequence,
        "paged_bytes": per_sequence * args.batch,
        "paged_rounding_bytes_per_sequence": per_sequence - _exact_bytes(shape, args.tokens, 1, args.dtype),
    }
    if args.budget is not None:
        figures["paged_blocks_in_budget"] = paged_blocks_in_budget(
            shape, args.budget, args.block_size, args.dtype)
        figures["max_paged_sequences_of_tokens"] = max_paged_sequences(
            shape, args.budget, args.tokens, args.block_size, args.dtype)
        figures["max_paged_sequences_by_kv_dtype"] = {  # what --kv-cache-dtype would hold
            dtype: max_paged_sequences(shape, args.budget, args.tokens, args.block_size, dtype)
            for dtype in ("float32", "bfloat16", *PACKED_KV_DTYPES)
        }
    return figures


def _exact_bytes(shape: KVShape, tokens: int, batch: int, dtype: str) -> int:
    """KV bytes of `batch` sequences of `tokens` tokens, no block rounding: every row a layer holds
    at `paged_row_bytes` (a packed dtype's scale and zero included; a float dtype's, its elements)."""
    rows = 2 * sum(shape.tokens_held(tokens)) * shape.kv_heads * batch
    return rows * paged_row_bytes(shape.head_dim, dtype)


def _print_paged(result: dict, args: argparse.Namespace) -> None:
    per_sequence = result["paged_bytes_per_sequence"]
    print(f"  paged, blocks of {args.block_size} tokens: one sequence {per_sequence:,} B "
          f"({format_bytes(per_sequence)}, of which "
          f"{result['paged_rounding_bytes_per_sequence']:,} B unused in its last block); batch of "
          f"{args.batch}: {result['paged_bytes']:,} B")
    if args.budget is not None:
        print(f"  paged, in {_budget_text(args)}: {result['paged_blocks_in_budget']:,} "
              f"blocks; sequences of {args.tokens:,} tokens: {result['max_paged_sequences_of_tokens']:,}")
        by_dtype = result["max_paged_sequences_by_kv_dtype"].items()
        fits = ", ".join(f"{count:,} at {dtype}" for dtype, count in by_dtype)
        print(f"  paged, sequences of {args.tokens:,} tokens by --kv-cache-dtype (scales counted): {fits}")
