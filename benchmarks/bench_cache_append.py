"""Per-step append cost vs cache length: our DynamicLayer and StaticLayer against
transformers' DynamicLayer (torch.cat onto the history), side by side in one run.

A "step" is one decoded token through every layer: `layers` updates of one (B, H_kv, 1, D)
key/value row each. For each length L, a fresh cache of each implementation is prefilled with
L - window tokens in one chunk, then `window` single-token steps are timed one by one, the
implementations taking turns in blocks, in an order that rotates from pass to pass.
The figure at L is over the steps that bring the cache to lengths L-window+1 .. L; a growth
copy of our DynamicLayer that falls in the window shows in the mean, not in the median. A first
pass is a discarded warm-up (page faults, allocator growth), so every figure is warm; the table
gives, per length, the lowest of the passes' medians (the JSON also has each pass's median,
the pooled median, mean and p90).

    .venv/bin/python benchmarks/bench_cache_append.py            # up to 8192 tokens
    .venv/bin/python benchmarks/bench_cache_append.py --quick    # up to 2048, two passes

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


def time_steps(
    caches: dict[str, list], args: argparse.Namespace, length: int, first: int
) -> dict[str, list[int]]:
    """Prefill every cache to length - window in one chunk, then time `window` single-token
    steps of each implementation in turn (a block each, starting with number `first`).

    Blocks rather than step-by-step turns: transformers' torch.cat streams the whole history
    through the CPU caches on every step, which would make the next implementation's step run
    cold. Returns {clock: {name: [ns per step]}} for both clocks: "wall" (perf_counter) and
    "cpu" (this thread's CPU time, which leaves out time spent descheduled by other jobs)."""
    prefill = length - args.window
    step_key = torch.randn(args.batch, args.kv_heads, 1, args.head_dim)  # (B, H_kv, 1, D)
    step_value = torch.randn(args.batch, args.kv_heads, 1, args.head_dim)
    if prefill > 0:
        chunk = torch.randn(args.batch, args.kv_heads, prefill, args.head_dim)  # (B, H, T, D)
        for layers in caches.values():
            for layer in layers:
                layer.update(chunk, chunk)
    wall: Callable[[], int] = time.perf_counter_ns
    cpu: Callable[[], int] = time.thread_time_ns
    times: dict[str, dict[str, list[int]]] = {
        "wall": {name: [] for name in caches},
        "cpu": {name: [] for name in caches},
    }
    names = list(caches)
    for name in names[first:] + names[:first]:
        layers = caches[name]
        for _ in range(args.window):
            start_cpu, start_wall = cpu(), wall()
            for layer in layers:
                layer.update(step_key, step_value)
            end_wall, end_cpu = wall(), cpu()
            times["wall"][name].append(end_wall - start_wall)
            times["cpu"][name].append(end_cpu - start_cpu)
    return times


def summarise(passes: list[list[int]]) -> dict[str, float]:
    """Per-step figures in µs: the median of each pass, the best (lowest) of those medians,
    and the pooled median, mean (growth copies included) and p90 of every step."""
    medians = [statistics.median(times) / 1000 for times in passes]
    pooled = sorted(t / 1000 for times in passes for t in times)
    return {
        "median_us": min(medians),
        "pass_medians_us": medians,
        "pooled_median_us": statistics.median(pooled),
        "mean_us": statistics.fmean(pooled),
        "p90_us": pooled[int(0.9 * (len(pooled) - 1))],
        "samples": len(pooled),
    }


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    names = list(IMPLEMENTATIONS)
    lengths = [length for length in args.lengths if length <= args.max_len]
    clocks = ("cpu", "wall")
    passes: dict[str, dict[str, dict[int, list[list[int]]]]] = {
        clock: {name: {length: [] for length in lengths} for name in names} for clock in clocks
    }
    for repeat in range(args.repeats + 1):  # pass 0 is the warm-up, discarded
        for position, length in enumerate(lengths):
            caches = {name: make_layers(name, args) for name in names}
            times = time_steps(caches, args, length, (repeat + position) % len(names))
            del caches
            if repeat:
                for clock in clocks:
                    for name in names:
                        passes[clock][name][length].append(times[clock][name])
    tables = {
        clock: {
            name: {length: summarise(passes[clock][name][length]) for length in lengths}
            for name in names
        }
        for clock in clocks
    }
    first, last = lengths[0], lengths[-1]

    def ratios(table: dict) -> tuple[dict, dict]:
        growth = {name: table[name][last]["median_us"] / table[name][first]["median_us"]
                  for name in names}
        versus = {
            name: {
                str(length): table[name][length]["median_us"]
                / table["hf_dynamic"][length]["median_us"]
                for length in lengths
            }
            for name in ("ours_dynamic", "ours_static")
        }
        return growth, versus

    growth, versus = ratios(tables[args.clock])
    other = "wall" if args.clock == "cpu" else "cpu"
    other_growth, other_versus = ratios(tables[other])
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
        "clock": args.clock,
        "per_step": {
            name: {str(k): v for k, v in rows.items()} for name, rows in tables[args.clock].items()
        },
        "ratio_last_vs_first": {"lengths": [last, first], **growth},
        "ours_vs_theirs_median": versus,
        "other_clock": {
            "clock": other,
            "per_step": {
                name: {str(k): v for k, v in rows.items()} for name, rows in tables[other].items()
            },
            "ratio_last_vs_first": {"lengths": [last, first], **other_growth},
            "ours_vs_theirs_median": other_versus,
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
    last, first = result["ratio_last_vs_first"]["lengths"]
    clock = {"cpu": "thread CPU time", "wall": "wall time"}[result["clock"]]
    other = result["other_clock"]
    lines = [
        f"Per-step append cost, µs of {clock} (median; one token through {shape['layers']} "
        f"layers × "
        f"{shape['kv_heads']} kv heads × {shape['head_dim']} dims, batch {shape['batch']}, "
        f"fp32, warm, {result['threads']} thread(s); per length the lowest of "
        f"{result['repeats']} passes' medians over the {result['window']} steps ending there). "
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
    other_growth = [f"{other['ratio_last_vs_first'][n]:.2f}×" for n in names]
    lines.append(
        f"| {last} vs {first}, {other['clock']} time | " + " | ".join(other_growth) + " | | |"
    )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="up to 2048 tokens, two passes")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5, help="measured passes (after warm-up)")
    parser.add_argument("--window", type=int, default=128, help="steps per reported length")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="clock of the table: this thread's CPU time (default; robust to other jobs on a "
        "shared machine) or wall time; the JSON has both",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_append")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_len, args.repeats, args.window = 2048, 2, 64
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
