"""The fast lane (`make test-fast`, `pytest --fast`) runs torch on one thread: its tensors are tiny,
and two threads on a shared 2-core machine spin waiting for each other whenever one is
descheduled (docs/testing.md has the figures)."""

from __future__ import annotations

import pytest
import torch


def test_the_fast_lane_runs_torch_on_one_thread(request):
    if not request.config.getoption("--fast"):
        pytest.skip("the whole suite keeps torch's own thread count")
    assert torch.get_num_threads() == 1
