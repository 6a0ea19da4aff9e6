"""The fast lane (`make test-fast`, `pytest --fast`) runs torch on one thread: its tensors are tiny,
and two threads on a shared 2-core machine spin waiting for each other whenever one is
descheduled (docs/testing.md has the figures)."""

from __future__ import annotations

import subprocess
import sys

import torch


def test_the_fast_lane_runs_torch_on_one_thread_and_the_whole_suite_on_its_own_count(request):
    if request.config.getoption("--fast"):
        assert torch.get_num_threads() == 1
    else:  # the whole suite: torch's own count, what a fresh interpreter in this environment picks
        fresh = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                               capture_output=True, text=True, check=True, timeout=300)
        assert torch.get_num_threads() == int(fresh.stdout)
