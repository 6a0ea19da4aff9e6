"""Choosing a decode backend for a model by a fixed rule, never by timing.

"auto": the block step for a model whose weights are a GGUF's kept blocks, the float32 step for
float32 weights on CPU, the half step for bfloat16 or float16 ones, each where it can stand in
for the model (every module one whose forward it computes, none hooked: `<step>.unsupported`),
else the model's torch forward. The rule is checked at every call, which costs a walk over the
modules; a step is built once per model (its weights are laid out) and kept while it still
matches the model (`matches`), so a second `generate` pays nothing more and a model whose
parameters were replaced, moved, cast (or, for the half step, written to) gets a new one.
"""

from __future__ import annotations

import weakref

from kvcache.backends.base import Backend, BackendError
from kvcache.backends.cpu import block_step, float32_step, half_step
from kvcache.backends.cpu.block_step import BlockBackend
from kvcache.backends.cpu.float32_step import Float32Backend
from kvcache.backends.cpu.half_step import HalfBackend
from kvcache.backends.torch_step import TorchBackend
from kvcache.defaults import BACKEND_NAMES

BACKENDS = BACKEND_NAMES

# model -> its Float32Backend / HalfBackend, kept while it matches
_built: dict[type, weakref.WeakKeyDictionary] = {
    kind: weakref.WeakKeyDictionary() for kind in (Float32Backend, HalfBackend, BlockBackend)}


def _kept(kind: type, model) -> Backend:
    backend = _built[kind].get(model)
    if backend is None or not backend.matches(model):
        backend = _built[kind][model] = kind(model)
    return backend


def choose_backend(model, backend: str | Backend | None = "auto") -> Backend:
    """The decode backend for `model`: a Backend as given; "torch" (the model's forward);
    "float32", "half" or "blocks" (raise `BackendError` saying why if the model is not one they can
    run);
    "auto" or None (the rule in the module docstring)."""
    if isinstance(backend, Backend):
        if not backend.matches(model):
            raise BackendError(
                f"this {type(backend).__name__} was built from another model, or the model changed "
                "since (parameters replaced, moved or cast): build a new one, or pass backend='auto'"
            )
        return backend
    if backend is None:
        backend = "auto"
    if backend not in BACKENDS:
        raise BackendError(f"backend must be one of {BACKENDS} or a Backend, got {backend!r}")
    if backend == "torch":
        return TorchBackend(model)
    if backend == "float32":
        float32_step.require_supported(model)
        return _kept(Float32Backend, model)
    if backend == "half":
        half_step.require_supported(model)
        return _kept(HalfBackend, model)
    if backend == "blocks":
        block_step.require_supported(model)
        return _kept(BlockBackend, model)
    if block_step.unsupported(model) is None:
        return _kept(BlockBackend, model)
    if float32_step.unsupported(model) is None:
        return _kept(Float32Backend, model)
    if half_step.unsupported(model) is None:
        return _kept(HalfBackend, model)
    return TorchBackend(model)
