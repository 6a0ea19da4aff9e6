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
from kvcache.backends.numpy_step import NumpyBackend, unsupported
from kvcache.backends.torch_step import TorchBackend

BACKENDS = ("auto", "numpy", "torch")

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
        return backend
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS} or a DecodeBackend, got {backend!r}")
    if backend == "torch":
        return TorchBackend(model)
    reason = unsupported(model)
    if reason is None:
        return _numpy_backend(model)
    if backend == "numpy":
        raise BackendError(f"the numpy backend cannot run this model: {reason}; use the torch backend")
    return TorchBackend(model)
