"""Argument types shared by the commands: each error names what was expected and what was given."""

from __future__ import annotations

import argparse

from kvcache.memory import PAGED_KV_DTYPES, kv_dtype_name, parse_size

#: the epilog of the commands that run a model: why resident memory is about twice the weights
WEIGHTS_HELD_TWICE = (
    "Memory: a float32 or bfloat16 model's projection weights are held twice, once row by row for "
    "the one-row decode kernels and once in oneDNN's blocked layout for prompts and steps of "
    "several rows (about twice as fast there as the row layout), so resident memory is about twice "
    "the weights plus the KV cache; a GGUF file's weights are dequantized to float32 first."
)


def add_speculate(parser, looked_up_in: str) -> None:
    """--speculate: `GenerationSettings.speculate` (its methods, `settings.METHODS`); drafts are
    looked up in `looked_up_in` (what the command's help says)."""
    parser.add_argument("--speculate", choices=("ngram",),
                        help=f"ngram: each decode step also verifies a draft looked up in {looked_up_in} "
                        "(prompt lookup); the same tokens as without, to the bit (a paged cache; a GGUF "
                        "with q8 activations)")


def add_activations(parser) -> None:
    """--activations: how a GGUF's weights kept as blocks read their input
    (`kvcache.model.load_model`'s activations); `activations_of` reads it."""
    parser.add_argument(
        "--activations", choices=("auto", "q8", "float32"), default="auto",
        help="how a GGUF's weights kept as blocks multiply: q8 rounds the activations to 8 bits (each "
        "32 values; each 256 for the K-quants) as llama.cpp's CPU products do, its arithmetic and "
        "about twice float32's decode speed, an approximation that picks the float32 path's own "
        "next token at nearly every step (docs/model.md: the measured agreement); float32: the "
        "dequantized weight's exact product; auto (default): q8 for a GGUF file without --dtype, "
        "float32 otherwise",
    )


def activations_of(args) -> str:
    """`load_model`'s activations argument that --activations gives (ValueError naming the flags
    for q8 with --dtype, which dequantizes every weight: no blocks are left to read them)."""
    if args.activations == "q8" and getattr(args, "dtype", None):
        raise ValueError(f"--activations q8 multiplies a GGUF's weights kept as blocks; --dtype {args.dtype} "
                         "dequantizes them all: give one of the two")
    return args.activations


def add_kv_cache_dtype(parser) -> None:
    """--kv-cache-dtype: the KV cache's keys and values stored as the model computes them (auto)
    or in a dtype of their own in a paged cache (`kvcache.cache.paged.formats`)."""
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", *PAGED_KV_DTYPES), default="auto",
        help="store keys and values in a paged cache as bfloat16 or float16, or quantized: each "
        "token's kv head one group of fp8 (e4m3), int8 or int4 codes with a float16 scale (about "
        "0.27x, 0.27x or 0.14x float32's bytes at head_dim 64), an approximation of the exact "
        "cache; auto (default): as the model computes them",
    )
    for kind in ("k", "v"):
        parser.add_argument(
            f"--kv-{kind}-dtype", choices=PAGED_KV_DTYPES, default=None,
            help=f"the {'keys' if kind == 'k' else 'values'}' dtype apart (default: --kv-cache-dtype's; "
            "give both, e.g. --kv-k-dtype bfloat16 --kv-v-dtype int4)",
        )
    parser.add_argument(
        "--kv-window", type=nonnegative_int, default=0, metavar="TOKENS",
        help="with --kv-cache-dtype: keep each sequence's last TOKENS tokens also in the model's dtype "
        "and read them from there (a full-precision window of recent tokens, as KIVI and transformers' "
        "QuantizedCache keep; its bytes come out of the KV budget); default 0: none",
    )


def kv_dtype_of(args) -> str | None:
    """The PagedCache kv_dtype that --kv-cache-dtype, --kv-k-dtype and --kv-v-dtype give (None:
    as computed; "int8/int4": int8 keys, int4 values). ValueError naming the flags when only one
    of keys and values has a dtype (the model's dtype is not known here: name both)."""
    both = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    keys, values = args.kv_k_dtype or both, args.kv_v_dtype or both
    if (keys is None) != (values is None):
        given = "--kv-k-dtype" if keys else "--kv-v-dtype"
        raise ValueError(f"{given} sets one of keys and values apart: give the other's dtype too "
                         f"(--kv-k-dtype/--kv-v-dtype, e.g. the model's own) or --kv-cache-dtype")
    return None if keys is None else kv_dtype_name(keys, values)


def kv_window_of(args) -> int:
    """--kv-window's tokens, after checking that a kv dtype gives it something to keep apart
    (ValueError naming the flags)."""
    if args.kv_window and kv_dtype_of(args) is None:
        raise ValueError(f"--kv-window {args.kv_window} keeps recent tokens in full precision beside blocks "
                         f"stored in another dtype: give --kv-cache-dtype (or --kv-k-dtype and --kv-v-dtype)")
    return args.kv_window


def _int_at_least(text: str, minimum: int, expected: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return value


def size_argument(text: str) -> int:
    """A size in bytes: "8GiB", "512MB", "1048576" (`kvcache.memory.parse_size`)."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def folder_argument(text: str) -> str:
    """A folder's path, not empty (an empty one would be taken as the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder's path, got an empty one")
    return text


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    """An integer ≥ 0."""
    return _int_at_least(text, 0, "an integer >= 0")


def int_list(text: str) -> list[int]:
    """"1,2,4,...,256" -> [1, 2, 4, 8, …, 256]. A comma list of positive integers; `...` doubles
    when the two numbers before it double, else repeats their step, up to the number after it."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    values: list[int] = []
    for index, part in enumerate(parts):
        if part == "...":
            if len(values) < 2 or index + 1 >= len(parts):
                raise argparse.ArgumentTypeError(
                    f"'...' needs two numbers before it and one after, in {text!r}")
            end = positive_int(parts[index + 1])
            a, b = values[-2], values[-1]
            while True:
                nxt = b * 2 if b == 2 * a else b + (b - a)
                if nxt >= end or nxt <= b:
                    break
                values.append(nxt)
                a, b = b, nxt
            continue
        values.append(positive_int(part))
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of integers, got {text!r}")
    return values


def float_list(text: str) -> list[float]:
    """A comma list of numbers."""
    try:
        return [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
