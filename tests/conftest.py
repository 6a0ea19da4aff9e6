"""Fixtures shared by the whole suite (the models themselves are built in tiny_models.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from tiny_models import ARCHS, hf_model, save_checkpoint


@pytest.fixture(scope="module")
def one_thread():
    """Run a module's tests with one torch thread: tiny matrices gain nothing from threads,
    and on a shared 2-core machine threads wait on each other."""
    from kvcache.backends import torch_threads

    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (checkpoint folder, the transformers model it was saved from); see tiny_models."""
    torch.manual_seed(1234)
    root = tmp_path_factory.mktemp("checkpoints")
    built = {}
    for arch in ARCHS:
        model = hf_model(arch)
        built[arch] = (save_checkpoint(model, root / arch), model)
    return built


@pytest.fixture(scope="session")
def llama_dir(checkpoints) -> Path:
    return checkpoints["llama"][0]


@pytest.fixture
def llama_copy(llama_dir, tmp_path) -> Path:
    """A private copy of the llama checkpoint, for tests that damage it."""
    return Path(shutil.copytree(llama_dir, tmp_path / "copy"))


# ---- the fast lane (`make test-fast`: `pytest --fast`) -------------------------------------------
# Every test that compiles or loads a numba kernel is marked `kernels`, every one that starts a
# server or a child process `processes`; --fast deselects both, and fails a test left unmarked
# that does either, so the lane stays what it says.

def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the fast lane: deselect tests marked kernels or processes, and fail any "
                          "other test that compiles a numba kernel or starts a server or a process")


def pytest_configure(config):
    """In --fast, one torch thread for the whole run: the lane's tensors are tiny, and two threads
    on a shared 2-core machine wait for each other (spinning) whenever one is descheduled, which
    makes the same tests several times slower beside other work (docs/testing.md)."""
    if config.getoption("--fast"):
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    slow = [item for item in items
            if item.get_closest_marker("kernels") or item.get_closest_marker("processes")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        kept = set(map(id, slow))
        items[:] = [item for item in items if id(item) not in kept]


class _Refused(Exception):
    """What a fast-lane test did that only a marked test may do."""


@pytest.fixture(autouse=True)
def _fast_lane_guard(request, monkeypatch):
    """In --fast, refuse a numba compile (or cache load), a listening socket and a child process."""
    if not request.config.getoption("--fast"):
        yield
        return
    import socket
    import subprocess

    from numba.core import event

    def refuse(what: str, mark: str):
        def refused(*args, **kwargs):
            raise _Refused(f"{request.node.nodeid} {what}: mark it `pytest.mark.{mark}`")
        return refused

    compiled = []

    class Compiles(event.Listener):  # (recorded, not raised: numba holds its lock here)
        def on_start(self, event_):
            compiled.append(event_)

        def on_end(self, event_):
            pass

    monkeypatch.setattr(socket.socket, "listen", refuse("starts a server", "processes"))
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("starts a process", "processes"))
    with event.install_listener("numba:compiler_lock", Compiles()):
        yield
    if compiled:
        pytest.fail(f"{request.node.nodeid} compiles or loads a numba kernel: mark it `pytest.mark.kernels`")
