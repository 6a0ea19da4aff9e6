"""Decode speed of kvcache.generate against transformers' generate on the same weights.

    .venv/bin/python benchmarks/bench_generate.py            # both models, 3 rounds: ~13 minutes
    .venv/bin/python benchmarks/bench_generate.py --models small --new-tokens 32
    .venv/bin/python benchmarks/bench_generate.py --baseline /tmp/old   # another checkout too

For each model (a ~100M random Llama and a ~3M one, float32, saved once with transformers'
save_pretrained) every configuration runs in its own process (so no two share thread
pools or caches, and peak memory is that configuration's own): kvcache with a paged cache (the
default backend, "auto", and the torch and float32 backends named), a dynamic and a static cache
(the model's own forward), and no cache; transformers with its dynamic cache, static cache and
no cache; with `--baseline DIR`,
also kvcache's rows as the checkout in DIR runs them (its own benchmark's worker, its own
source), for a before/after comparison. Each process warms up once, then times `--repeats`
runs (its fastest kept); all configurations run `--rounds` times in turn, and the table gives
each configuration's median over the rounds and, for kvcache, the median and range of its speed
over transformers' (and over the baseline's same row) measured in the same round, so a busy
spell on a shared machine hits both sides of a ratio. Figures: time to first token, decode
tokens/s (after the first token), the weight bandwidth that decode speed implies, and peak
resident memory.
Results: benchmarks/results/generate.json and generate.md. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import Stamps, commit

MODELS = {
    "100m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        intermediate_size=2048,
        vocab_size=32000,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=512,
    ),
}
# (library, cache, backend); the backend only matters for kvcache
CONFIGS = [
    ("kvcache", "paged", "auto"),
    ("kvcache", "paged", "torch"),
    ("kvcache", "paged", "float32"),
    ("kvcache", "dynamic", "auto"),
    ("kvcache", "static", "auto"),
    ("kvcache", "none", "auto"),
    ("transformers", "dynamic", None),
    ("transformers", "static", None),
    ("transformers", "none", None),
]
RESULTS = Path(__file__).parent / "results"


def build_checkpoint(name: str, folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**MODELS[name], eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def worker(args: argparse.Namespace) -> None:
    """Run one configuration; print one JSON line."""
    import torch

    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(1)
    new_tokens = args.nocache_new_tokens if args.cache == "none" else args.new_tokens
    if args.library == "kvcache":
        from kvcache import generate, load_model

        model = load_model(args.checkpoint, dtype=torch.float32)
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=generator)
        ran = []

        def run():
            result = generate(
                model, prompt, max_new_tokens=new_tokens, cache=args.cache, backend=args.kernel,
                eos_token_id=(),
            )
            ran.append(result.backend)
            return result.time_to_first_token_s, result.decode_tokens_per_s, result.new_tokens[0]
    else:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
        vocab = model.config.vocab_size
        prompt = torch.randint(0, vocab, (1, args.prompt_tokens), generator=generator)
        options = {"use_cache": False} if args.cache == "none" else {}
        if args.cache == "static":
            options["cache_implementation"] = "static"

        def run():
            stamps = Stamps()
            started = time.perf_counter()
            with torch.inference_mode():
                out = model.generate(
                    prompt,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    streamer=stamps,
                    pad_token_id=0,
                    **options,
                )
            first, last = stamps.times[1], stamps.times[-1]  # times[0] is the prompt
            steps = len(stamps.times) - 2
            return first - started, steps / (last - first), out[0, args.prompt_tokens :].tolist()

    run()  # warm-up: allocator growth, thread pools, first-call paths
    best = None
    for _ in range(args.repeats):
        ttft, tokens_per_s, tokens = run()
        if best is None or tokens_per_s > best[1]:
            best = (ttft, tokens_per_s, tokens)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embedding = (
        model.get_input_embeddings().weight
        if hasattr(model, "get_input_embeddings")
        else (model.model.embed_tokens.weight)
    )
    # a decode step reads every matrix once except the embedding table (one row of it)
    read_per_token = weight_bytes - embedding.numel() * embedding.element_size()
    chosen = args.kernel
    if args.library == "kvcache":
        chosen = f"{args.kernel}: {ran[-1]}"
        chosen += f", {args.threads} thr"
    print(
        json.dumps(
            {
                "library": args.library,
                "cache": args.cache,
                "kernel": chosen,
                "new_tokens": new_tokens,
                "ttft_ms": best[0] * 1000,
                "decode_tokens_per_s": best[1],
                "weight_gb_per_s": read_per_token * best[1] / 1e9,
                "peak_rss_mb": _peak_rss_mb(),
                "parameters": sum(p.numel() for p in model.parameters()),
                "tokens": best[2],
            }
        )
    )


def _peak_rss_mb() -> float:
    """This process's peak resident memory. VmHWM, since Linux carries ru_maxrss over exec from
    the parent (the driver, which imported transformers to write the checkpoints)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_config(checkpoint: Path, library: str, cache: str, kernel, args, source: Path | None = None) -> dict:
    """One configuration in its own process; `source`: a baseline checkout whose own worker and
    source run it (its row is labelled "kvcache@baseline")."""
    script = Path(__file__) if source is None else source / "benchmarks" / "bench_generate.py"
    command = [
        sys.executable,
        str(script),
        "--worker",
        "--checkpoint",
        str(checkpoint),
        "--library",
        library,
        "--cache",
        cache,
        "--kernel",
        kernel or "torch",
        "--threads",
        str(args.threads),
        "--prompt-tokens",
        str(args.prompt_tokens),
        "--new-tokens",
        str(args.new_tokens),
        "--nocache-new-tokens",
        str(args.nocache_new_tokens),
        "--repeats",
        str(args.repeats),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    if source is not None:
        env["PYTHONPATH"] = str(source / "src")
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{library}/{cache} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["requested"] = kernel or ""
    if source is not None:
        row["library"] = "kvcache@baseline"
    return row


def _same_round_ratios(rounds: list[list[dict]], index: int, other) -> list[float]:
    """Row `index`'s decode speed over that of the row `other(row)` picks, round by round."""
    ratios = []
    for round_rows in rounds:
        mine = round_rows[index]
        theirs = [r for r in round_rows if other(mine, r)]
        if theirs:
            ratios.append(mine["decode_tokens_per_s"] / theirs[0]["decode_tokens_per_s"])
    return ratios


def summarise(rounds: list[list[dict]]) -> list[dict]:
    """One row per configuration over the rounds: medians of its figures, and for kvcache the
    median and range of its decode speed over transformers' with the same cache, and over the
    baseline checkout's same configuration, *in the same round* (side by side, so a busy spell
    that slows one round slows both sides of its ratio)."""
    rows = []
    for index in range(len(rounds[0])):
        runs = [round_rows[index] for round_rows in rounds]
        row = dict(runs[0])
        for key in ("ttft_ms", "decode_tokens_per_s", "weight_gb_per_s"):
            row[key] = statistics.median([run[key] for run in runs])
        row["peak_rss_mb"] = max(run["peak_rss_mb"] for run in runs)
        row["decode_per_round"] = [run["decode_tokens_per_s"] for run in runs]
        if row["library"] == "kvcache":
            row["ratios"] = _same_round_ratios(
                rounds, index, lambda mine, r: r["library"] == "transformers" and r["cache"] == mine["cache"]
            )
            row["baseline_ratios"] = _same_round_ratios(
                rounds, index, lambda mine, r: r["library"] == "kvcache@baseline"
                and (r["cache"], r["requested"]) == (mine["cache"], mine["requested"])
            )
        rows.append(row)
    return rows


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})" if ratios else ""


def table(results: dict) -> str:
    lines = []
    for name, rows in results["models"].items():
        params = rows[0]["parameters"]
        baseline = any(r["library"] == "kvcache@baseline" for r in rows)
        lines += [
            f"### {name} Llama ({params / 1e6:.1f}M parameters), prompt {results['prompt_tokens']}, "
            f"batch 1, float32, {results['threads']} threads, {results['rounds']} rounds",
            "",
            "| library | cache | backend | new tokens | decode tokens/s (median) | weights GB/s | time to "
            "first token | peak RSS | decode ours/theirs, median (range) of rounds | "
            + ("decode ours/baseline, median (range) | " if baseline else "")
            + "same tokens |",
            "|---|---|---|---|---|---|---|---|---|" + ("---|" if baseline else "") + "---|",
        ]
        theirs = {r["cache"]: r for r in rows if r["library"] == "transformers"}
        for r in rows:
            ref = theirs.get(r["cache"])
            same = ""
            if r["library"].startswith("kvcache") and ref:
                same = "yes" if r["tokens"] == ref["tokens"] else "no"
            kernel = r["kernel"] if r["library"].startswith("kvcache") else ""
            lines.append(
                f"| {r['library']} | {r['cache']} | {kernel} "
                f"| {r['new_tokens']} | {r['decode_tokens_per_s']:.1f} | {r['weight_gb_per_s']:.1f} "
                f"| {r['ttft_ms']:.1f} ms | {r['peak_rss_mb']:.0f} MB | {_spread(r.get('ratios', []))} | "
                + (f"{_spread(r.get('baseline_ratios', []))} | " if baseline else "")
                + f"{same} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="100m,small", help="comma list of: " + ", ".join(MODELS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--nocache-new-tokens",
        type=int,
        default=32,
        help="new tokens for the no-cache runs (each step re-reads the whole context)",
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per process (best kept)")
    parser.add_argument(
        "--rounds", type=int, default=3, help="passes over all configurations (medians, per-round ratios)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another kvcache checkout (e.g. a git worktree of the commit before a change): its "
        "kvcache rows run too, each right after ours, with its own benchmark worker and source",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    parser.add_argument("--kernel", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    results = {
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} CPUs".strip(),
        "load_average_at_start": os.getloadavg(),
        "threads": args.threads,
        "prompt_tokens": args.prompt_tokens,
        "rounds": args.rounds,
        "baseline": None if args.baseline is None else str(args.baseline),
        "commit": commit(Path(__file__).parent),
        "baseline_commit": None if args.baseline is None else commit(args.baseline),
        "models": {},
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            checkpoint = Path(scratch) / name
            build_checkpoint(name, checkpoint)
            rounds: list[list[dict]] = []
            for _ in range(args.rounds):  # rounds interleave the libraries, so a busy spell hits both
                rounds.append([])
                for library, cache, kernel in CONFIGS:
                    sources = [None]
                    if library == "kvcache" and args.baseline is not None:
                        sources.append(args.baseline)
                    for source in sources:
                        row = run_config(checkpoint, library, cache, kernel, args, source)
                        rounds[-1].append(row)
                        print(
                            f"{name:6s} {row['library']:16s} {cache:8s} {kernel or '':6s} "
                            f"{row['decode_tokens_per_s']:8.1f} tok/s  ttft {row['ttft_ms']:7.1f} ms",
                            flush=True,
                        )
            results["models"][name] = summarise(rounds)
    results["load_average_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate.json").write_text(json.dumps(results, indent=1) + "\n")
    text = table(results)
    (args.out / "generate.md").write_text(
        f"Measured with `{' '.join(['python', *sys.argv])}` on {results['machine']}; load average "
        f"{results['load_average_at_start'][0]:.1f} at start, {results['load_average_at_end'][0]:.1f} at end "
        "(the machine is shared: compare rows of one run, not runs).\n\n" + text
    )
    print(text)


if __name__ == "__main__":
    main()
