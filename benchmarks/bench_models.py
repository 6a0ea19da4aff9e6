"""The models people run, side by side with llama.cpp on the same GGUF files, through the commands
a user runs.

    benchmarks/build_llama_cpp.sh                       # llama-bench, once
    .venv/bin/kvcache pull qwen2.5-coder-0.5b           # the second model, once
    .venv/bin/python benchmarks/bench_models.py --llama-bench PATH [--model NAME_OR_FILE ...]

Per model (default: `smollm2` and `qwen2.5-coder-0.5b`, names `kvcache models` lists, or GGUF
files), `--rounds` alternating rounds (kvcache first on even rounds, llama.cpp first on odd) of:

- decode at depth 128: `kvcache generate -m FILE --prompt - --max-tokens N --json` on a prompt of
  about 128 tokens (its decode tokens/s, default settings) against `llama-bench -p 0 -n N -d 128`;
- decode at depth 4096: the same on a prompt of about 4,096 tokens against `-d 4096`;
- prompt: `generate` on a prompt of about 512 tokens, prompt tokens over its time to first token,
  against `llama-bench -p 512 -n 0`;
- beside one busy process (`python3 -c "while True: pass"`): the depth-128 decode of both again,
  each over its own quiet figure of the round (`busy_over_quiet`).

Each ratio is kvcache's over llama.cpp's in the same round; the keys are their medians. Also per
model: `first_run_compile_s` (a `generate` with an empty numba cache folder, wall seconds, less
the same command's with the cache warm), `peak_rss_mb` (the depth-128 `generate`'s peak resident
set, the largest over rounds) and `rss_budget_mb`: the file + its KV cache (float32, prompt and new
tokens) + the process's own baseline + 64 MB, the baseline being the peak resident set of the same
`generate` on the bundled 3.2M-parameter model (libraries imported, kernels compiled, its weights
and cache a few MB). Every command and every round is written to benchmarks/results/models.json.
With `--llama-server PATH`, also the served ratios `ratio_serve_1` and `ratio_serve_16`:
bench_serve_gguf.py's rounds (`kvcache serve` against `llama-server` on the same file, 1 and 16
streaming clients, `--serve-rounds` each), their runs kept beside the key. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import commit

RESULTS = Path(__file__).parent / "results"
BUSY = [sys.executable, "-c", "while True: pass"]
WORDS = ("the cache keeps keys and values so that each step projects one token and attends over "
         "the stored ones while memory not compute caps how many conversations one machine serves ").split()


def prompt_of(tokens: int) -> str:
    """Plain text of about `tokens` tokens (a word is about one token to these tokenizers)."""
    return " ".join(WORDS[i % len(WORDS)] for i in range(tokens))


def run_child(command: list[str], stdin: str = "", env: dict | None = None) -> tuple[str, float, float]:
    """(stdout, wall seconds, peak RSS MB) of a command run to its end; SystemExit when it fails."""
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                   env=env)
        process.stdin.write(stdin)
        process.stdin.close()
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if process.returncode != 0:
            raise SystemExit(f"bench_models: {' '.join(command)} failed ({process.returncode}):\n"
                             f"{err.read()[-3000:]}")
        return out.read(), wall, usage.ru_maxrss / 1024


def kvcache_generate(model: str | None, prompt_tokens: int, new_tokens: int, env: dict | None = None) -> dict:
    """One `kvcache generate --json` run (model None: the bundled one): its JSON report, wall
    seconds and peak RSS MB."""
    command = [sys.executable, "-m", "kvcache", "generate", *(["-m", model] if model else []),
               "--prompt", "-", "--max-tokens", str(new_tokens), "--json"]
    out, wall, rss = run_child(command, prompt_of(prompt_tokens), env)
    report = json.loads(out)
    report.update(wall_s=wall, peak_rss_mb=rss, command=" ".join(command[1:]))
    report["prompt_tokens_per_s"] = report["prompt_tokens"] / report["time_to_first_token_s"]
    return report


def llama_bench(binary: str, gguf: str, threads: int, prompt: int, new: int, depth: int) -> float:
    """llama-bench's tokens/s of one test (-p prompt -n new -d depth)."""
    command = [binary, "-m", gguf, "-t", str(threads), "-o", "json", "-r", "2",
               "-p", str(prompt), "-n", str(new), "-d", str(depth)]
    out, _, _ = run_child(command)
    return float(json.loads(out)[0]["avg_ts"])


def one_round(model: str, gguf: str, args, first: bool) -> dict:
    """kvcache and llama.cpp on every measure, in the round's order."""
    new, threads, binary = args.new_tokens, args.threads, args.llama_bench
    ours = {
        "decode": lambda: kvcache_generate(model, 128, new),
        "decode_4096": lambda: kvcache_generate(model, 4096, new),
        "prompt": lambda: kvcache_generate(model, 512, 1),
    }
    theirs = {
        "decode": lambda: llama_bench(binary, gguf, threads, 0, new, 128),
        "decode_4096": lambda: llama_bench(binary, gguf, threads, 0, new, 4096),
        "prompt": lambda: llama_bench(binary, gguf, threads, 512, 0, 0),
    }
    row = {}
    for measure in ours:
        sides = [("kvcache", ours[measure]), ("llama.cpp", theirs[measure])]
        for side, run in sides if first else sides[::-1]:
            print(f"  {measure}: {side}…", file=sys.stderr, flush=True)
            row.setdefault(measure, {})[side] = run()
    busy = subprocess.Popen(BUSY)
    try:
        print("  decode beside a busy process…", file=sys.stderr, flush=True)
        row["busy"] = {"kvcache": ours["decode"](), "llama.cpp": theirs["decode"]()}
    finally:
        busy.kill()
        busy.wait()
    return row


def ratios(row: dict) -> dict:
    """The round's ratios: kvcache over llama.cpp per measure, and each one's busy over quiet."""
    def ours(measure: str, key: str = "decode_tokens_per_s") -> float:
        return row[measure]["kvcache"][key]

    return {
        "ratio_decode": ours("decode") / row["decode"]["llama.cpp"],
        "ratio_decode_4096": ours("decode_4096") / row["decode_4096"]["llama.cpp"],
        "ratio_prompt": ours("prompt", "prompt_tokens_per_s") / row["prompt"]["llama.cpp"],
        "busy_over_quiet": ours("busy") / ours("decode"),
        "llama_cpp_busy_over_quiet": row["busy"]["llama.cpp"] / row["decode"]["llama.cpp"],
    }


def first_run_compile_s(model: str) -> float:
    """Wall seconds a `generate` spends compiling kernels on a first run: with an empty numba
    cache folder, less the same command's with that folder then filled."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "NUMBA_CACHE_DIR": folder}
        cold = kvcache_generate(model, 128, 8, env)["wall_s"]
        warm = kvcache_generate(model, 128, 8, env)["wall_s"]
    return cold - warm


def kv_mb(gguf: str, tokens: int) -> float:
    """A float32 cache's MB for `tokens` tokens of the file's model: 2·layers·kv_heads·tokens·head_dim·4."""
    from kvcache.model.gguf_file import gguf_config

    config = gguf_config(gguf)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * tokens * head_dim * 4 / 1e6


def served_ratios(gguf: str, args) -> dict:
    """`ratio_serve_1` and `ratio_serve_16` (bench_serve_gguf.py's medians over its rounds) and
    their runs (`served`)."""
    from bench_serve_gguf import run as serve_rounds

    found, served = {}, {}
    for clients in (1, 16):
        print(f"{Path(gguf).name}: served, {clients} client(s)…", file=sys.stderr, flush=True)
        options = argparse.Namespace(llama_server=args.llama_server, threads=args.threads, new_tokens=64,
                                     prompt_words=120, clients=clients, rounds=args.serve_rounds)
        served[clients] = serve_rounds(options, gguf)
        found[f"ratio_serve_{clients}"] = served[clients]["ratio_vs_llama_server"]
    return {**found, "served": served}


def measure_model(model: str, args, baseline_mb: float) -> dict:
    from kvcache.defaults import resolve_model_dir

    gguf = str(resolve_model_dir(model))
    print(f"{model}: warming up (kernels compiled, file read; not timed)…", file=sys.stderr, flush=True)
    kvcache_generate(model, 16, 4)
    rounds = []
    for index in range(args.rounds):
        print(f"{model}: round {index + 1} of {args.rounds}", file=sys.stderr, flush=True)
        row = one_round(model, gguf, args, index % 2 == 0)
        rounds.append({"measures": row, "ratios": ratios(row)})
        print(f"  {json.dumps({k: round(v, 3) for k, v in rounds[-1]['ratios'].items()})}", file=sys.stderr)
    keys = rounds[0]["ratios"]
    result = {key: statistics.median(r["ratios"][key] for r in rounds) for key in keys}
    peak = max(r["measures"]["decode"]["kvcache"]["peak_rss_mb"] for r in rounds)
    tokens = rounds[0]["measures"]["decode"]["kvcache"]["prompt_tokens"] + args.new_tokens
    file_mb = Path(gguf).stat().st_size / 1e6
    budget = file_mb + kv_mb(gguf, tokens) + baseline_mb + 64
    if args.llama_server:
        result.update(served_ratios(gguf, args))
    print(f"{model}: a first run's compile (empty numba cache)…", file=sys.stderr, flush=True)
    result.update(first_run_compile_s=first_run_compile_s(model), peak_rss_mb=peak, rss_budget_mb=budget,
                  file_mb=file_mb, baseline_rss_mb=baseline_mb, gguf=Path(gguf).name, rounds=rounds)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    parser.add_argument("--model", action="append", help="a name `kvcache models` lists or a GGUF file "
                        "(default: smollm2 and qwen2.5-coder-0.5b)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary: also the served ratios")
    parser.add_argument("--serve-rounds", type=int, default=3, help="rounds a served measure (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS / "models.json")
    args = parser.parse_args()
    models = args.model or ["smollm2", "qwen2.5-coder-0.5b"]
    print("the baseline: generate on the bundled model…", file=sys.stderr, flush=True)
    kvcache_generate(None, 16, 4)  # (its kernels compiled first: a compile's memory is not the baseline)
    baseline = max(kvcache_generate(None, 128, args.new_tokens)["peak_rss_mb"] for _ in range(2))
    results = {"commit": commit(), "machine": platform.processor() or platform.machine(),
               "threads": args.threads, "new_tokens": args.new_tokens, "command": " ".join(sys.argv),
               "models": {model: measure_model(model, args, baseline) for model in models}}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for model, row in results["models"].items():
        print(model, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)})


if __name__ == "__main__":
    main()
