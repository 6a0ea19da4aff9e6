"""The fast lane (`make test-fast`, `pytest --fast`) runs torch on one thread: its tensors are tiny,
and two threads on a shared 2-core machine spin waiting for each other whenever one is
descheduled (docs/testing.md has the figures); the whole suite keeps torch's own count."""

from __future__ import annotations

from types import SimpleNamespace

import conftest
import torch


def test_the_fast_lane_sets_torch_to_one_thread_and_the_whole_suite_leaves_it():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        conftest.pytest_configure(SimpleNamespace(getoption=lambda name: False))
        assert torch.get_num_threads() == 2
        conftest.pytest_configure(SimpleNamespace(getoption=lambda name: name == "--fast"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
