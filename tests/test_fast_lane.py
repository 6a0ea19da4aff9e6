"""The fast lane (`make test-fast`, `pytest --fast`) runs torch on one thread: its tensors are tiny,
and two threads on a shared 2-core machine spin waiting for each other whenever one is
descheduled (docs/testing.md has the figures); the whole suite keeps torch's own count."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch


def test_the_fast_lane_sets_torch_to_one_thread_and_the_whole_suite_leaves_it(request):
    here = str(Path(__file__).with_name("conftest.py"))  # (the suite's own, as pytest loaded it)
    plugins = request.config.pluginmanager.get_plugins()
    conftest = next(plugin for plugin in plugins if getattr(plugin, "__file__", None) == here)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        conftest.pytest_configure(SimpleNamespace(getoption=lambda name: False))
        assert torch.get_num_threads() == 2
        conftest.pytest_configure(SimpleNamespace(getoption=lambda name: name == "--fast"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
