"""What the benchmarks share: percentiles of measured latencies, the commit they ran at, a free
loopback port for the servers they start.
Imported by the scripts beside it (run as `python benchmarks/bench_X.py`, so this folder is on
the path)."""

from __future__ import annotations

import socket
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Stamps:
    """A transformers streamer that only records when each put() happens (times[0]: the prompt,
    then one per new token)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass
