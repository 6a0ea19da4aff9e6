"""Choosing a decode backend for a model by a fixed rule, never by timing.

"auto": the numpy step when it can stand in for the model (float32 weights on CPU, every module
one whose forward it computes and none hooked: `numpy_step.unsupported`),
else the model's torch forward. The rule is checked at every call, which costs a walk over the
modules; a numpy backend is built once per model (its weights are packed) and kept while the
model still reads the packed memory (`NumpyBackend.matches`), so a second `generate` pays nothing
more and a model whose parameters were replaced, moved or cast gets a new one.
"""

from __future__ import annotations

import weakref

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.numpy_step import NumpyBackend, require_supported, unsupported
from kvcache.backends.torch_step import TorchBackend
from kvcache.kinds import BACKEND_NAMES

BACKENDS = BACKEND_NAMES

_numpy_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> NumpyBackend


def _numpy_backend(model) -> NumpyBackend:
    backend = _numpy_backends.get(model)
    if backend is None or not backend.matches(model):
        backend = _numpy_backends[model] = NumpyBackend(model)
    return backend


def choose_backend(model, backend: str | DecodeBackend | None = "auto") -> DecodeBackend:
    """The decode backend for `model`: a DecodeBackend as given; "torch" (the model's forward);
    "numpy" (raises `BackendError` saying why if the model is not one it can run); "auto" or None
    (the rule in the module docstring)."""
    if isinstance(backend, DecodeBackend):
        if not backend.matches(model):
            raise BackendError(
                f"this {type(backend).__name__} was built from another model, or the model changed "
                "since (parameters replaced, moved or cast): build a new one, or pass backend='auto'"
            )
        return backend
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS} or a DecodeBackend, got {backend!r}")
    if backend == "torch":
        return TorchBackend(model)
    if backend == "numpy":
        require_supported(model)
        return _numpy_backend(model)
    return TorchBackend(model) if unsupported(model) is not None else _numpy_backend(model)
