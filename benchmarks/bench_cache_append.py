"""Per-step append cost vs cache length: our DynamicLayer and StaticLayer against
transformers' DynamicLayer (torch.cat onto the history), side by side in one run.

A "step" is one decoded token through every layer: `layers` updates of one (B, H_kv, 1, D)
key/value row each. For each length L and each implementation, a fresh cache is prefilled with
L - window tokens in one chunk, then `window` single-token steps are timed one by one, so the
figure at L is over the steps that bring the cache to lengths L-window+1 .. L (a growth copy of
our DynamicLayer that falls in the window is included in the mean, not hidden). The three
implementations alternate inside each pass; a first pass is a discarded warm-up (page faults,
allocator growth), so every figure is warm.

    .venv/bin/python benchmarks/bench_cache_append.py            # up to 8192 tokens
    .venv/bin/python benchmarks/bench_cache_append.py --quick    # up to 2048, one pass

Writes benchmarks/results/cache_append.json and .md (or --out PREFIX).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers.cache_utils import DynamicLayer as HFDynamicLayer

from kvcache.cache import DynamicLayer, StaticLayer

RESULTS = Path(__file__).parent / "results"


def make_layers(name: str, args: argparse.Namespace) -> list:
    if name == "ours_dynamic":
        return [DynamicLayer() for _ in range(args.layers)]
    if name == "ours_static":
        return [
            StaticLayer(
                args.max_len,
                batch_size=args.batch,
                kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                dtype=torch.float32,
            )
            for _ in range(args.layers)
        ]
    return [HFDynamicLayer() for _ in range(args.layers)]


IMPLEMENTATIONS = {
    "ours_dynamic": "ours DynamicLayer",
    "ours_static": "ours StaticLayer",
    "hf_dynamic": f"transformers {transformers.__version__} DynamicLayer",
}


def time_steps(layers: list, args: argparse.Namespace, length: int) -> list[int]:
    """Prefill to length - window in one chunk, then time `window` single-token steps (ns)."""
    prefill = length - args.window
    step_key = torch.randn(args.batch, args.kv_heads, 1, args.head_dim)  # (B, H_kv, 1, D)
    step_value = torch.randn(args.batch, args.kv_heads, 1, args.head_dim)
    if prefill > 0:
        chunk = torch.randn(args.batch, args.kv_heads, prefill, args.head_dim)  # (B, H, T, D)
        for layer in layers:
            layer.update(chunk, chunk)
    clock: Callable[[], int] = time.perf_counter_ns
    times = []
    for _ in range(min(args.window, length)):
        start = clock()
        for layer in layers:
            layer.update(step_key, step_value)
        times.append(clock() - start)
    return times


def summarise(samples: list[int]) -> dict[str, float]:
    micro = [t / 1000 for t in samples]
    ordered = sorted(micro)
    return {
        "median_us": statistics.median(micro),
        "mean_us": statistics.fmean(micro),
        "p90_us": ordered[int(0.9 * (len(ordered) - 1))],
        "samples": len(micro),
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    names = list(IMPLEMENTATIONS)
    lengths = [length for length in args.lengths if length <= args.max_len]
    samples: dict[str, dict[int, list[int]]] = {name: {n: [] for n in lengths} for name in names}
    for repeat in range(args.repeats + 1):  # pass 0 is the warm-up, discarded
        for position, length in enumerate(lengths):
            shift = (repeat + position) % len(names)
            for name in names[shift:] + names[:shift]:
                times = time_steps(make_layers(name, args), args, length)
                if repeat:
                    samples[name][length].extend(times)
    table = {
        name: {length: summarise(samples[name][length]) for length in lengths} for name in names
    }
    first, last = lengths[0], lengths[-1]
    growth = {
        name: table[name][last]["median_us"] / table[name][first]["median_us"] for name in names
    }
    versus = {
        name: {
            length: table[name][length]["median_us"] / table["hf_dynamic"][length]["median_us"]
            for length in lengths
        }
        for name in ("ours_dynamic", "ours_static")
    }
    return {
        "what": "per-step append cost (one token through every layer) vs cache length, warm",
        "command": "benchmarks/bench_cache_append.py" + (" --quick" if args.quick else ""),
        "shape": {
            "layers": args.layers,
            "kv_heads": args.kv_heads,
            "head_dim": args.head_dim,
            "batch": args.batch,
            "dtype": "float32",
        },
        "max_len": args.max_len,
        "window": args.window,
        "repeats": args.repeats,
        "threads": args.threads,
        "environment": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": _cpu_name(),
        },
        "implementations": IMPLEMENTATIONS,
        "per_step": {name: {str(k): v for k, v in rows.items()} for name, rows in table.items()},
        "ratio_last_vs_first": {"lengths": [last, first], **growth},
        "ours_vs_theirs_median": {
            name: {str(k): v for k, v in rows.items()} for name, rows in versus.items()
        },
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(result: dict) -> str:
    names = list(IMPLEMENTATIONS)
    shape = result["shape"]
    lengths = [int(k) for k in result["per_step"]["hf_dynamic"]]
    first, last = result["ratio_last_vs_first"]["lengths"][1], result["ratio_last_vs_first"][
        "lengths"
    ][0]
    lines = [
        f"Per-step append cost, µs (median; one token through {shape['layers']} layers × "
        f"{shape['kv_heads']} kv heads × {shape['head_dim']} dims, batch {shape['batch']}, "
        f"fp32, warm, {result['threads']} thread(s); median of the {result['window']} steps "
        f"ending at each length × {result['repeats']} passes). "
        f"`{result['command']}`, torch {result['environment']['torch']}, "
        f"{result['environment']['processor']}.",
        "",
        "| cache length | " + " | ".join(IMPLEMENTATIONS[n] for n in names)
        + " | ours dynamic / theirs | ours static / theirs |",
        "|---:|" + "---:|" * (len(names) + 2),
    ]
    for length in lengths:
        cells = [f"{result['per_step'][n][str(length)]['median_us']:.1f}" for n in names]
        ratios = [
            f"{result['ours_vs_theirs_median'][n][str(length)]:.2f}×"
            for n in ("ours_dynamic", "ours_static")
        ]
        lines.append(f"| {length} | " + " | ".join(cells + ratios) + " |")
    growth = [f"{result['ratio_last_vs_first'][n]:.2f}×" for n in names]
    lines.append(f"| **{last} vs {first}** | " + " | ".join(growth) + " | | |")
    for length in (first, last):
        means = [f"{result['per_step'][n][str(length)]['mean_us']:.1f}" for n in names]
        lines.append(f"| mean at {length} (incl. growth copies) | " + " | ".join(means) + " | | |")
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 2048 tokens, one pass")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3, help="measured passes (after warm-up)")
    parser.add_argument("--window", type=int, default=128, help="steps per reported length")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_append")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_len, args.repeats, args.window = 2048, 1, 64
    if not 1 <= args.window <= 256:
        parser.error("--window must be in [1, 256] (the smallest length reported is 256)")
    args.lengths = [256, 512, 1024, 2048, 4096, 8192]
    if args.max_len not in args.lengths:
        args.lengths = [n for n in args.lengths if n < args.max_len] + [args.max_len]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    args.out.with_suffix(".md").write_text(table)
    print(table, end="")


if __name__ == "__main__":
    main()
