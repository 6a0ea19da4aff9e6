"""`kvcache generate` before and after a change of road, side by side, through the command a user
runs: this checkout's source against another checkout's (`--baseline DIR`, e.g. a `git worktree`
of the commit before), on the same GGUF files.

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/bench_generate_roads.py --baseline /tmp/before/src \
        [--model smollm2 --model qwen2.5-coder-0.5b] [--rounds 3] [--variant NAME=SRC:CACHE ...]

Each variant is a source folder put first on PYTHONPATH and a `--cache` (empty: the default).
Default variants: `before` (the baseline's default cache) and `after` (this checkout's).
`--rounds` alternating rounds (the order reversed every other round) of, per variant:
`kvcache generate -m MODEL --prompt - --max-tokens 48 --json --threads T` on a prompt of about
128 tokens (its decode tokens/s) and with `--max-tokens 1` on one of about 512 (prompt tokens
over its time to first token). The keys: per variant the medians, and its ratio over the first
variant in the same round, median over rounds. Results: benchmarks/results/generate_roads.json.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_common import commit
from bench_models import prompt_of

RESULTS = Path(__file__).parent / "results"
HERE = Path(__file__).resolve().parents[1] / "src"


def run(source: str, model: str, cache: str, prompt_tokens: int, new: int, threads: int) -> dict:
    """One `kvcache generate --json` run of `source`'s kvcache: its report and the command."""
    command = [sys.executable, "-m", "kvcache", "generate", "-m", model, "--prompt", "-", "--max-tokens",
               str(new), "--json", "--threads", str(threads), *(["--cache", cache] if cache else [])]
    env = dict(os.environ, PYTHONPATH=source)
    done = subprocess.run(command, input=prompt_of(prompt_tokens), capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    report = json.loads(done.stdout)
    return {"decode_tokens_per_s": report["decode_tokens_per_s"],
            "prompt_tokens_per_s": report["prompt_tokens"] / report["time_to_first_token_s"],
            "command": " ".join(command[1:])}


def one_round(model: str, variants: list[tuple[str, str, str]], threads: int, flip: bool) -> dict:
    """Every variant's decode and prompt figures in one round (order reversed when `flip`)."""
    row = {}
    for name, source, cache in (variants[::-1] if flip else variants):
        decode = run(source, model, cache, 128, 48, threads)
        prompt = run(source, model, cache, 512, 1, threads)
        row[name] = {"decode_tokens_per_s": decode["decode_tokens_per_s"],
                     "prompt_tokens_per_s": prompt["prompt_tokens_per_s"],
                     "commands": [decode["command"], prompt["command"]]}
        print(model, name, round(row[name]["decode_tokens_per_s"], 1),
              round(row[name]["prompt_tokens_per_s"], 1), file=sys.stderr, flush=True)
    return row


def summary(rounds: list[dict], first: str) -> dict:
    """Per variant: median decode and prompt tokens/s, and median ratios over `first`'s."""
    out = {}
    for name in rounds[0]:
        figures = {}
        for key in ("decode_tokens_per_s", "prompt_tokens_per_s"):
            figures[key] = statistics.median(r[name][key] for r in rounds)
            figures[f"ratio_{key.split('_')[0]}"] = statistics.median(
                r[name][key] / r[first][key] for r in rounds)
        out[name] = figures
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", required=True, help="the other checkout's src folder")
    parser.add_argument("--model", action="append", help="names `kvcache models` lists, or GGUF files")
    parser.add_argument("--variant", action="append", help="NAME=SRC:CACHE (SRC 'here': this checkout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS / "generate_roads.json")
    args = parser.parse_args()
    specs = args.variant or [f"before={args.baseline}:", "after=here:"]
    variants = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        source, _, cache = rest.partition(":")
        variants.append((name, str(HERE) if source == "here" else source, cache))
    results = {"commit": commit(), "baseline": args.baseline, "threads": args.threads,
               "variants": [list(v) for v in variants], "models": {}}
    for model in args.model or ["smollm2", "qwen2.5-coder-0.5b"]:
        rounds = [one_round(model, variants, args.threads, flip=i % 2 == 1) for i in range(args.rounds)]
        results["models"][model] = {"summary": summary(rounds, variants[0][0]), "rounds": rounds}
        print(json.dumps({model: results["models"][model]["summary"]}, indent=1))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
