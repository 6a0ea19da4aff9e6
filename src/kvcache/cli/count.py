"""`kvcache count`: the counted multiplications per token and in total, with and without a cache."""

from __future__ import annotations

import argparse
import json
import sys

from kvcache.cli._args import int_list, positive_int
from kvcache.reference.lab import DEFAULT_LENGTHS, count_table_markdown
from kvcache.reference.tables import mul_table


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d", type=positive_int, default=8,
                        help="model width d of the single head (default 8)")
    parser.add_argument("--lengths", type=int_list, default=list(DEFAULT_LENGTHS),
                        help="context lengths, e.g. 1,2,4,...,256 (the default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


# the lab multiplies by hand in Python, so its work grows as length² · d: the most it is asked to
# run is one context of 2,048 tokens at d = 8, or the same work spread over several lengths
MAX_WORK = 2048 * 2048 * 8


def run(args: argparse.Namespace) -> int:
    work = sum(length * length for length in args.lengths) * args.d
    if work > MAX_WORK or any(length < 1 for length in args.lengths):
        print(
            f"kvcache count: error: --lengths {','.join(map(str, args.lengths[:6]))}"
            f"{',…' if len(args.lengths) > 6 else ''} with --d {args.d} asks for {work:,} units of "
            f"hand-counted work (sum of length² × d), past the {MAX_WORK:,} the lab runs (one context "
            f"of 2,048 tokens at d 8); every length must be >= 1",
            file=sys.stderr,
        )
        return 2
    rows = mul_table(args.lengths, args.d, seed=args.seed)
    if args.json:
        print(json.dumps({"d": args.d, "rows": rows}, indent=2))
    else:
        print(f"Counted multiplications, one attention head, d = {args.d} "
              "(per token = the step that produces the last token):\n")
        print(count_table_markdown(rows))
    return 0
