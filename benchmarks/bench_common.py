"""What the benchmarks share: percentiles of measured latencies and the commit they ran at.
Imported by the scripts beside it (run as `python benchmarks/bench_X.py`, so this folder is on
the path)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by nearest rank; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def commit(folder: Path = Path(__file__).parent) -> str | None:
    """The git commit checked out in `folder` (None outside a git checkout)."""
    command = ["git", "-C", str(folder), "rev-parse", "--short", "HEAD"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    return done.stdout.strip() or None


class Stamps:
    """A transformers streamer that only records when each put() happens (times[0]: the prompt,
    then one per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
