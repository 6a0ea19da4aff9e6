"""How fast numpy's matrix-vector product streams a float32 weight from memory, by layout.

    .venv/bin/python benchmarks/probe_matvec_layout.py            # the two bench_generate models
    .venv/bin/python benchmarks/probe_matvec_layout.py --rounds 5

For each projection shape of the ~100M and ~3M benchmark models (fused q/k/v, o, fused gate/up,
down) it cycles through enough copies of the matrix to exceed the CPU caches (`--megabytes`),
computing `x @ W.T` for one row x, with W stored row-major (as loaded) and column-major (what
`kvcache.backends.cpu.packing` makes of the tall ones), and reports GB/s of weights
read, median over the passes. Rounds alternate the layouts, so a busy spell hits both.
Results: benchmarks/results/matvec_layout.md. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

# (out, in) of the decode step's matrices
SHAPES = {
    "~100M q/k/v": (1280, 768),
    "~100M o": (768, 768),
    "~100M gate/up": (4096, 768),
    "~100M down": (768, 2048),
    "~3M q/k/v": (512, 256),
    "~3M o": (256, 256),
    "~3M gate/up": (1376, 256),
    "~3M down": (256, 688),
}
RESULTS = Path(__file__).parent / "results"


def gigabytes_per_second(weights: list[np.ndarray], passes: int) -> float:
    """Median GB/s of one pass of `x @ w.T` over every matrix in `weights` (each (out, in))."""
    rows = np.random.default_rng(0).standard_normal((1, weights[0].shape[1])).astype(np.float32)
    transposed = [weight.T for weight in weights]  # (in, out) views
    nbytes = sum(weight.nbytes for weight in weights)

    def one_pass() -> None:
        for weight_t in transposed:
            rows @ weight_t

    one_pass()  # first touch
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        one_pass()
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=48, help="weights cycled through per pass")
    parser.add_argument("--passes", type=int, default=30, help="timed passes per layout and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lines = [
        f"Measured with `python benchmarks/probe_matvec_layout.py` on {platform.machine()}, "
        f"{os.cpu_count()} CPUs, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS', 'unset')}, "
        f"load average {os.getloadavg()[0]:.1f}; {args.megabytes} MB of weights per pass, "
        f"median of {args.passes} passes, {args.rounds} rounds.",
        "",
        "| matrix | (out, in) | row-major GB/s (median, range of rounds) | column-major GB/s | column/row |",
        "|---|---|---|---|---|",
    ]
    for name, (out, inner) in SHAPES.items():
        copies = max(1, (args.megabytes << 20) // (out * inner * 4))
        row_major = [rng.standard_normal((out, inner)).astype(np.float32) for _ in range(copies)]
        column_major = [np.ascontiguousarray(weight.T).T for weight in row_major]
        rates: dict[str, list[float]] = {"row": [], "column": []}
        for _ in range(args.rounds):
            rates["row"].append(gigabytes_per_second(row_major, args.passes))
            rates["column"].append(gigabytes_per_second(column_major, args.passes))
        row, column = statistics.median(rates["row"]), statistics.median(rates["column"])
        ratios = [c / r for c, r in zip(rates["column"], rates["row"], strict=True)]
        lines.append(
            f"| {name} | ({out}, {inner}) | {row:.1f} ({min(rates['row']):.1f}–{max(rates['row']):.1f}) "
            f"| {column:.1f} ({min(rates['column']):.1f}–{max(rates['column']):.1f}) "
            f"| {statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) |"
        )
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "matvec_layout.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out / 'matvec_layout.md'}")


if __name__ == "__main__":
    main()
