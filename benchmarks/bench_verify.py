"""`kvcache verify` on a real model: random prompts run cold, in chunks of 1, 16 and 64 tokens, as
a prefix-cache hit, read back from the disk tier by a second engine, and beside 7 random
neighbours in one batch; every greedy stream compared with the cold one.

    .venv/bin/python benchmarks/bench_verify.py [-m qwen2.5-coder-0.5b] [--prompts 200]

Runs the command a user runs (`kvcache verify ... --json`) and writes its answer, the command,
the commit and the wall time to benchmarks/results/verify_<model>.json. The property, not a
speed: `differing` is 0 on every road where the backend is chunk-invariant.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

from bench_common import commit

RESULTS = Path(__file__).parent / "results"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args()
    command = [sys.executable, "-m", "kvcache", "verify", "-m", args.model, "--prompts", str(args.prompts),
               "--prompt-tokens", str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--json"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if not done.stdout.strip():
        print(done.stderr, file=sys.stderr)
        return 1
    answer = json.loads(done.stdout)
    differing = sum(len(road["differing"]) for road in answer["roads"].values())
    results = {
        "commit": commit(), "machine": platform.machine(), "model": args.model,
        "command": "kvcache " + " ".join(command[3:]), "exit_status": done.returncode,
        "wall_s": round(time.perf_counter() - started, 1), "differing_streams": differing, **answer,
    }
    name = Path(args.model).stem if Path(args.model).exists() else args.model
    out = RESULTS / f"verify_{name}.json"
    out.write_text(json.dumps(results, indent=1) + "\n")
    for road, found in answer["roads"].items():
        print(f"{road:>16}: {found['equal']} equal, {len(found['differing'])} differing")
    print(f"{differing} differing streams; wrote {out}")
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
