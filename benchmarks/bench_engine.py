"""The serving engine against transformers on one seeded request set, side by side in one run.

    .venv/bin/python benchmarks/bench_engine.py                      # both models (long)
    .venv/bin/python benchmarks/bench_engine.py --models default --requests 16 --concurrency 1,4

Requests: `--requests` prompts of 64 to 1,024 tokens (shorter where the model's context is
shorter), greedy, `--new-tokens` each; half of them start with the same 512-token system prompt.
Models: the bundled default model, and a ~135M Llama of SmolLM2-135M's shape (random weights,
hidden 576, 30 layers, 9 heads / 3 kv heads, vocab 49,152, tied embeddings), float32, 2 threads.
Every configuration runs in its own process and sees every request at once (offline):
- kvcache's engine at each `--concurrency` (max running sequences), prefix sharing on; at 16 also
  with prefix sharing off;
- transformers' continuous batching (`generate_batch`, the engine behind `transformers serve
  --continuous-batching`) with that many requests per batch;
- transformers `generate` on padded static batches of that many requests, one batch after the
  other;
- a long-prompt run: 15 streams decoding, then a 2,048-token prompt arriving mid-run; the p99 of
  the streams' inter-token latencies over their median says whether the long prefill froze them.
Figures: output tokens/s (all generated tokens over the wall time), decode tokens/s (the engine's
decode forwards alone), time to first token and inter-token latency (p50/p99, from each
request's token timestamps; every request is submitted at the start, so TTFT includes queueing),
prompt tokens prefilled. Results: benchmarks/results/engine.json and engine.md. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import commit, percentile

RESULTS = Path(__file__).parent / "results"
SMOLLM2_SHAPE = dict(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


def requests_for(vocab: int, context: int, count: int, new_tokens: int, seed: int = 0) -> list[list[int]]:
    """The seeded request set: prompt ids, half starting with one shared 512-token system prompt."""
    import random

    rng = random.Random(seed)
    longest = min(1024, context - new_tokens)
    system = [rng.randrange(vocab) for _ in range(min(512, longest // 2))]
    prompts = []
    for index in range(count):
        length = rng.randint(min(64, longest), longest)
        if index % 2:
            prompts.append(system + [rng.randrange(vocab) for _ in range(max(1, length - len(system)))])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(length)])
    return prompts


def _latencies(first_times: list[float | None], token_times: list[list[float]]) -> dict:
    gaps = [later - earlier for times in token_times for earlier, later in zip(times, times[1:])]
    firsts = [t for t in first_times if t is not None]
    return {
        "ttft_p50_ms": 1e3 * percentile(firsts, 0.5),
        "ttft_p99_ms": 1e3 * percentile(firsts, 0.99),
        "itl_p50_ms": 1e3 * (percentile(gaps, 0.5) or 0),
        "itl_p99_ms": 1e3 * (percentile(gaps, 0.99) or 0),
    }


def run_kvcache(
    model_dir: str, prompts: list[list[int]], new_tokens: int, concurrency: int, prefix: bool
) -> dict:
    import kvcache
    from kvcache.engine import Engine

    model = kvcache.load_model(model_dir)

    def engine():
        return Engine(
            model,
            kv_budget="2GiB",
            block_size=16,
            max_running=concurrency,
            token_budget=max(256, concurrency),
            prefix_caching=prefix,
        )

    engine().generate([prompts[0][:32]], max_tokens=4, ignore_eos=True)  # warm-up: backend, pools
    serving = engine()
    started = time.perf_counter()
    results = serving.generate(
        prompts,
        max_tokens=new_tokens,
        ignore_eos=True,
        progress=lambda done, total: print(f"\r{done}/{total}", end="", file=sys.stderr),
    )
    wall = time.perf_counter() - started
    print(file=sys.stderr)
    metrics = serving.metrics
    return {
        "wall_s": wall,
        "generated": sum(len(r.tokens) for r in results),
        "tokens_per_s": sum(len(r.tokens) for r in results) / wall,
        "decode_tokens_per_s": metrics.decode_tokens_per_s,
        "prefill_tokens": metrics.prefill_tokens,
        "cached_prompt_tokens": metrics.cached_prompt_tokens,
        "preemptions": metrics.preemptions,
        **_latencies([r.time_to_first_token_s for r in results], [r.token_times_s for r in results]),
        "tokens": [r.tokens for r in results],
    }


def run_kvcache_long_prompt(model_dir: str, prompts: list[list[int]], new_tokens: int) -> dict:
    """15 streams decode; a 2,048-token prompt arrives after they made 16 tokens each."""
    import random

    import kvcache
    from kvcache.engine import Engine

    model = kvcache.load_model(model_dir)
    engine = Engine(model, kv_budget="2GiB", block_size=16, max_running=16, token_budget=256)
    engine.generate([prompts[0][:32]], max_tokens=4, ignore_eos=True)
    streams = [engine.submit(prompt[:128], max_tokens=new_tokens, ignore_eos=True) for prompt in prompts[:15]]
    while not engine.running or min(len(r.generated) for r in engine.running) < 16:
        engine.step()
    rng = random.Random(1)
    long_prompt = [rng.randrange(model.config.vocab_size) for _ in range(2048)]
    late = engine.submit(long_prompt, max_tokens=16, ignore_eos=True)
    while not all(handle.done for handle in (*streams, late)):
        engine.step()
    times = [handle.result().token_times_s for handle in streams]
    gaps = [b - a for t in times for a, b in zip(t, t[1:])]
    median, p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
    return {
        "itl_p50_ms": 1e3 * median,
        "itl_p99_ms": 1e3 * p99,
        "itl_p99_over_median": p99 / median,
        "long_prompt_ttft_ms": 1e3 * late.result().time_to_first_token_s,
    }


def run_transformers_cb(model_dir: str, prompts: list[list[int]], new_tokens: int, concurrency: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    tokens_total = sum(len(p) + new_tokens for p in prompts)
    batching = ContinuousBatchingConfig(
        num_blocks=-(-tokens_total // 16) + 64,
        page_size=16,
        max_batch_tokens=max(256, concurrency),
        max_requests_per_batch=concurrency,
    )
    model.generate_batch(
        [prompts[0][:32]],
        generation_config=GenerationConfig(
            max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0
        ),
        continuous_batching_config=batching,
        warmup=False,
    )
    started = time.perf_counter()
    out = model.generate_batch(
        prompts,
        generation_config=config,
        continuous_batching_config=batching,
        record_timestamps=True,
        warmup=False,
    )
    wall = time.perf_counter() - started
    ordered = [out[f"req_{index}"] for index in range(len(prompts))]
    tokens = [list(o.generated_tokens) for o in ordered]
    stamps = [[t - o.created_time for t in (o.timestamps or [])] for o in ordered]
    return {
        "wall_s": wall,
        "generated": sum(map(len, tokens)),
        "tokens_per_s": sum(map(len, tokens)) / wall,
        **_latencies([s[0] if s else None for s in stamps], stamps),
        "tokens": tokens,
    }


def run_transformers_static(model_dir: str, prompts: list[list[int]], new_tokens: int, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    class Stamps:
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def padded(group):
        width = max(map(len, group))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        return ids, mask

    with torch.inference_mode():
        model.generate(*padded([prompts[0][:32]])[:1], max_new_tokens=4, do_sample=False, pad_token_id=0)
    started = time.perf_counter()
    tokens, firsts, token_times = [], [], []
    for index in range(0, len(prompts), batch):
        group = prompts[index : index + batch]
        ids, mask = padded(group)
        stamps = Stamps()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
                streamer=stamps,
            )
        tokens += out[:, ids.shape[1] :].tolist()
        times = [t - started for t in stamps.times[1:]]  # stamps.times[0] is the prompt
        firsts += [times[0]] * len(group)
        token_times += [times] * len(group)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "generated": sum(map(len, tokens)),
        "tokens_per_s": sum(map(len, tokens)) / wall,
        **_latencies(firsts, token_times),
        "tokens": tokens,
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    prompts = json.loads(Path(args.prompts).read_text())
    if args.kind == "kvcache":
        row = run_kvcache(
            args.model_dir, prompts, args.new_tokens, args.concurrency, prefix=not args.no_prefix
        )
    elif args.kind == "kvcache-long":
        row = run_kvcache_long_prompt(args.model_dir, prompts, args.new_tokens)
    elif args.kind == "transformers-cb":
        row = run_transformers_cb(args.model_dir, prompts, args.new_tokens, args.concurrency)
    else:
        row = run_transformers_static(args.model_dir, prompts, args.new_tokens, args.concurrency)
    print(json.dumps(row))


def run(
    kind: str, model_dir: Path, prompts_file: Path, concurrency: int, args, no_prefix: bool = False
) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        "--kind",
        kind,
        "--model-dir",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        "--concurrency",
        str(concurrency),
        "--threads",
        str(args.threads),
        "--new-tokens",
        str(args.new_tokens),
    ] + (["--no-prefix"] if no_prefix else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENBLAS_NUM_THREADS": str(args.threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{kind} at {concurrency} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row.update(kind=kind, concurrency=concurrency, prefix=not no_prefix)
    print(
        f"  {kind:20s} c={concurrency:3d} {row.get('tokens_per_s', 0):8.1f} tok/s  "
        f"ttft p50 {row.get('ttft_p50_ms') or 0:8.1f} ms  itl p99 {row.get('itl_p99_ms', 0):7.1f} ms",
        flush=True,
    )
    return row


def bench_model(name: str, model_dir: Path, scratch: Path, args) -> dict:
    config = json.loads((model_dir / "config.json").read_text())
    prompts = requests_for(
        config["vocab_size"], config["max_position_embeddings"], args.requests, args.new_tokens
    )
    prompts_file = scratch / f"{name}-prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for level in levels:
        rows.append(run("kvcache", model_dir, prompts_file, level, args))
        rows.append(run("transformers-cb", model_dir, prompts_file, level, args))
        rows.append(run("transformers-static", model_dir, prompts_file, level, args))
    if 16 in levels:
        rows.append(run("kvcache", model_dir, prompts_file, 16, args, no_prefix=True))
    if config["max_position_embeddings"] >= 2048 + args.new_tokens:
        rows.append(run("kvcache-long", model_dir, prompts_file, 16, args))
    by = {(r["kind"], r["concurrency"], r["prefix"]): r for r in rows}
    ours = {level: by[("kvcache", level, True)] for level in levels}
    reference = ours[levels[0]]["tokens"]
    summary = {
        "model": name,
        "requests": len(prompts),
        "new_tokens": args.new_tokens,
        "prompt_tokens": sum(map(len, prompts)),
        "tokens_per_s": {
            kind: {level: by[(kind, level, True)]["tokens_per_s"] for level in levels}
            for kind in ("kvcache", "transformers-cb", "transformers-static")
        },
        "decode_tokens_per_s": {level: ours[level]["decode_tokens_per_s"] for level in levels},
        "same_tokens_as_kvcache_at_lowest": {
            f"{kind}@{level}": by[(kind, level, True)]["tokens"] == reference
            for kind in ("kvcache", "transformers-cb", "transformers-static")
            for level in levels
        },
        "requests_differing_from_kvcache_at_lowest": {
            f"{kind}@{level}": sum(a != b for a, b in zip(by[(kind, level, True)]["tokens"], reference))
            for kind in ("kvcache", "transformers-cb", "transformers-static")
            for level in levels
        },
        "rows": [{k: v for k, v in row.items() if k != "tokens"} for row in rows],
    }
    if 1 in levels and 16 in levels:
        summary["speedup_16_vs_1"] = ours[16]["decode_tokens_per_s"] / ours[1]["decode_tokens_per_s"]
        summary["ratio_vs_transformers_cb_16"] = (
            ours[16]["tokens_per_s"] / by[("transformers-cb", 16, True)]["tokens_per_s"]
        )
    if 16 in levels:
        summary["prefix_prefill_tokens_on"] = ours[16]["prefill_tokens"]
        summary["prefix_prefill_tokens_off"] = by[("kvcache", 16, False)]["prefill_tokens"]
        summary["prefix_ttft_p50_ms_on"] = ours[16]["ttft_p50_ms"]
        summary["prefix_ttft_p50_ms_off"] = by[("kvcache", 16, False)]["ttft_p50_ms"]
    long = by.get(("kvcache-long", 16, True))
    if long:
        summary["itl_p99_over_median_long_prompt"] = long["itl_p99_over_median"]
    return summary


def build_smollm2_shape(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SMOLLM2_SHAPE, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)


def _figure(value) -> str:
    return "" if value is None else f"{value:.1f}"


def markdown(results: dict) -> str:
    lines = [
        f"Measured with `{results['command']}` on {results['machine']} at {results['commit']}; load "
        f"average {results['load_average_at_start'][0]:.1f} at start, "
        f"{results['load_average_at_end'][0]:.1f} at end.",
        "",
    ]
    for summary in results["models"]:
        lines += [
            f"### {summary['model']}: {summary['requests']} requests, {summary['prompt_tokens']:,} prompt "
            f"tokens, {summary['new_tokens']} new tokens each",
            "",
            "| engine | max running | output tokens/s | decode tokens/s | TTFT p50 / p99 | ITL p50 / p99 | "
            "prompt tokens prefilled | requests whose tokens differ from kvcache at the lowest level |",
            "|---|---:|---:|---:|---|---|---:|---:|",
        ]
        for row in summary["rows"]:
            if row["kind"] == "kvcache-long":
                continue
            name = row["kind"] + ("" if row["prefix"] else ", prefix sharing off")
            differ = summary["requests_differing_from_kvcache_at_lowest"].get(
                f"{row['kind']}@{row['concurrency']}", ""
            )
            lines.append(
                f"| {name} | {row['concurrency']} | {row['tokens_per_s']:.1f} | "
                f"{_figure(row.get('decode_tokens_per_s'))} | "
                f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} ms | "
                f"{row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} ms | {row.get('prefill_tokens', '')} | "
                f"{'' if differ == '' else str(differ) + ' of ' + str(summary['requests'])} |"
            )
        for key in (
            "speedup_16_vs_1",
            "ratio_vs_transformers_cb_16",
            "itl_p99_over_median_long_prompt",
            "prefix_prefill_tokens_on",
            "prefix_prefill_tokens_off",
        ):
            if key in summary:
                value = summary[key]
                lines.append(f"- {key}: {value:.2f}" if isinstance(value, float) else f"- {key}: {value}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,135m", help="comma list of: default, 135m")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for hidden in ("--kind", "--model-dir", "--prompts"):
        parser.add_argument(hidden, help=argparse.SUPPRESS)
    parser.add_argument("--no-prefix", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.concurrency = int(args.concurrency)
        worker(args)
        return
    from kvcache.defaults import default_model_dir

    results = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "load_average_at_start": os.getloadavg(),
        "models": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models.split(","):
            print(name, flush=True)
            if name == "default":
                folder = default_model_dir()
            else:
                folder = Path(scratch) / name
                build_smollm2_shape(folder)
            results["models"].append(bench_model(name, Path(folder), Path(scratch), args))
    results["load_average_at_end"] = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "engine.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
