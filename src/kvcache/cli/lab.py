"""`kvcache lab`: the whole KV-cache lab in one run, as Markdown (and optionally JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvcache.cli._args import int_list, positive_int
from kvcache.reference.lab import DEFAULT_LENGTHS, lab_markdown, run_lab


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d", type=positive_int, default=8, help="single-head width (default 8)")
    parser.add_argument("--lengths", type=int_list, default=list(DEFAULT_LENGTHS),
                        help="context lengths of the count table (default 1,2,4,...,256)")
    parser.add_argument("--tokens", type=positive_int, default=32,
                        help="tokens in the equality and rounding checks (default 32)")
    parser.add_argument("--decimals", type=int_list, default=[12, 10, 8, 6, 4, 3, 2, 1],
                        help="precisions k and v are rounded to before caching")
    parser.add_argument("--rtol", type=float, default=1e-9, help="relative tolerance (default 1e-9)")
    parser.add_argument("--atol", type=float, default=1e-12, help="absolute tolerance (default 1e-12)")
    parser.add_argument("--layers", type=positive_int, default=2, help="memory table: layers")
    parser.add_argument("--heads", type=positive_int, default=2, help="memory table: kv heads")
    parser.add_argument("--head-dim", type=positive_int, default=4, help="memory table: head dim")
    parser.add_argument("--memory-lengths", type=int_list, default=[128, 1024, 8192],
                        help="memory table: tokens")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    parser.add_argument("--out", help="also write the Markdown to this file")
    parser.add_argument("--json", action="store_true", help="print JSON instead of Markdown")


def run(args: argparse.Namespace) -> int:
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out else None
    if args.out and (os.path.isdir(args.out) or not os.path.isdir(folder)):
        what = "is a directory" if os.path.isdir(args.out) else "is in a folder that does not exist"
        print(f"kvcache lab: error: --out {args.out} {what}; give a file path", file=sys.stderr)
        return 2
    print("kvcache lab: counting multiplications (a few seconds)...", file=sys.stderr)
    result = run_lab(d=args.d, lengths=args.lengths, tokens=args.tokens, decimals=args.decimals,
                     rtol=args.rtol, atol=args.atol, layers=args.layers, heads=args.heads,
                     head_dim=args.head_dim, memory_lengths=args.memory_lengths, seed=args.seed)
    markdown = lab_markdown(result)
    if args.out:
        try:
            with open(args.out, "w", encoding="utf-8") as handle:
                handle.write(markdown)
        except OSError as error:
            print(f"kvcache lab: error: cannot write --out {args.out}: {error.strerror}", file=sys.stderr)
            return 2
        print(f"kvcache lab: wrote {args.out}", file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else markdown, end="" if not args.json else "\n")
    return 0
