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
