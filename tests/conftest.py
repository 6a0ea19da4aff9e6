"""Fixtures shared by the whole suite."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one torch thread: tiny matrices gain nothing from threads,
    and on a shared 2-core machine threads wait on each other."""
    from kvcache.model.kernels import torch_threads

    with torch_threads(1):
        yield
