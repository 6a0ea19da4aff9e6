"""`kvcache drift`: how far a quantized KV cache moves the model's output, against tolerance.

    kvcache drift                                  # the default model, int8, int4 and fp8
    kvcache drift --model DIR --bits 8,4 --tokens 64 --json

Prints a Markdown table (or, with --json, one JSON object per setting per line); progress goes
to stderr. torch is imported inside `run`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvcache.cli._args import positive_int


def bits_list(text: str) -> list[int | str]:
    """"8,4,fp8" -> [8, 4, "fp8"]."""
    values: list[int | str] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        if part in ("8", "4"):
            values.append(int(part))
        elif part == "fp8":
            values.append("fp8")
        else:
            raise argparse.ArgumentTypeError(f"bits are 8, 4 or fp8 (comma-separated), got {part!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list such as 8,4,fp8, got {text!r}")
    return values


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model",
                        help="local checkpoint folder, GGUF file or a model name such as smollm2, as every "
                             "command takes it (default: kvcache's trained default model)")
    parser.add_argument("--bits", type=bits_list, default=[8, 4, "fp8"],
                        help="settings to measure: 8, 4, fp8, comma-separated (default 8,4,fp8)")
    parser.add_argument("--tokens", type=positive_int, default=128,
                        help="greedy tokens generated per prompt (default 128)")
    parser.add_argument("--group-size", type=positive_int, default=32, help="quantization group (default 32)")
    parser.add_argument("--residual", type=int, default=32,
                        help="most recent tokens kept in full precision (default 32)")
    parser.add_argument("--key-axis", choices=("channel", "token"), default="channel",
                        help="keys: a scale per channel (default) or per token")
    parser.add_argument("--value-axis", choices=("token", "channel"), default="token",
                        help="values: a scale per token (default) or per channel")
    parser.add_argument("--prompt", action="append", default=[],
                        help="prompt text (repeatable; default: three built-in prompts)")
    parser.add_argument("--min-agreement", type=float, default=0.99,
                        help="tolerance: least greedy agreement, free-running and teacher-forced (0.99)")
    parser.add_argument("--max-kl", type=float, default=1e-3,
                        help="tolerance: largest mean KL in nats (1e-3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: as stored")
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="one JSON object per setting per line")


def _prompts(folder: Path, texts: list[str], vocab_size: int):
    """Token-id prompts: the texts through the checkpoint's tokenizer, or (no tokenizer.json)
    three seeded random prompts of 32 ids."""
    import torch

    from kvcache.defaults import is_gguf

    if is_gguf(folder) or (folder / "tokenizer.json").is_file():
        from kvcache.report.drift import DEFAULT_PROMPTS
        from kvcache.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(folder)
        return [torch.tensor(tokenizer.encode(text)) for text in (texts or DEFAULT_PROMPTS)], "text"
    if texts:
        raise ValueError(f"{folder} has no tokenizer.json to encode --prompt with")  # (a GGUF carries one)
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (32,), generator=generator) for _ in range(3)], "random ids"


def run(args: argparse.Namespace) -> int:
    import torch

    from kvcache.model import load_model
    from kvcache.report.drift import DriftSetting, Tolerance, default_model_dir, drift_table, measure_drift

    if args.threads:
        torch.set_num_threads(args.threads)
    from kvcache.defaults import resolve_model_dir

    try:
        folder = Path(resolve_model_dir(args.model)) if args.model else default_model_dir()
    except ValueError as error:  # a known name not pulled yet
        print(f"kvcache drift: error: {error}", file=sys.stderr)
        return 2
    if not args.model and not (folder / "config.json").is_file():
        print(f"kvcache drift: error: the default model is not installed at {folder}; "
              f"pass --model DIR", file=sys.stderr)
        return 2
    if args.residual < 0:
        print(f"kvcache drift: error: --residual must be >= 0, got {args.residual}", file=sys.stderr)
        return 2
    try:
        model = load_model(folder, dtype=args.dtype)
        prompts, source = _prompts(folder, args.prompt, model.config.vocab_size)
    except (ValueError, OSError) as error:
        print(f"kvcache drift: error: {error}", file=sys.stderr)
        return 2
    settings = [
        DriftSetting(bits, args.group_size, args.residual, args.key_axis, args.value_axis)
        for bits in args.bits
    ]
    tolerance = Tolerance(args.min_agreement, args.min_agreement, args.max_kl)
    print(f"kvcache drift: {folder}, {len(prompts)} prompts ({source}), {args.tokens} tokens each",
          file=sys.stderr)
    try:
        results = measure_drift(
            model, prompts, settings, tokens=args.tokens, tolerance=tolerance,
            progress=lambda line: print(f"kvcache drift: {line}", file=sys.stderr, flush=True),
        )
    except ValueError as error:
        print(f"kvcache drift: error: {error}", file=sys.stderr)
        return 2
    failed = [result for result in results if not result.within_tolerance]
    status = 1 if failed else 0  # a row out of tolerance (or that measured nothing) fails the run
    if args.json:
        for result in results:
            print(json.dumps(result.to_dict()))
        return status
    print(f"Drift of quantized KV caches against the unquantized cache: {folder.name}, {model.dtype}, "
          f"{len(prompts)} prompts ({source}), {args.tokens} greedy tokens each.\n")
    print(drift_table(results))
    print(f"\nWithin tolerance = greedy agreement (free-running and teacher-forced) >= "
          f"{tolerance.greedy_agreement} and mean KL <= {tolerance.mean_kl:g} nats.")
    if any(result.quantized_fraction == 0 for result in results):
        print("kvcache drift: nothing was quantized in some rows: every token stayed in the "
              "full-precision residual; lower --residual or raise --tokens", file=sys.stderr)
    if failed:
        print(f"kvcache drift: {len(failed)} of {len(results)} rows not within tolerance", file=sys.stderr)
    return status
