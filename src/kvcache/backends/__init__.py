"""Backends: one step over the rows of a paged cache, built from a model.

    backend = choose_backend(model)            # "auto": blocks (GGUF), numpy (fp32), half, torch
    logits = backend.step(model, batch)        # a PagedBatch -> (sampled rows, vocab)

`TorchBackend` runs the model's forward (the reference road); the CPU backends run it on numba's
kernels over the paged blocks in place: `Float32Backend` (float32, packed once), `HalfBackend`
(bfloat16/float16), `BlockBackend` (a GGUF's blocks as stored). `generate` runs a one-request
step (reserve -> step -> commit) as the engine runs its batches. The model knows none of them.
"""

from kvcache.backends.base import Backend, BackendError
from kvcache.backends.choice import BACKENDS, choose_backend
from kvcache.backends.cpu.float32_step import Float32Backend
from kvcache.backends.cpu.half_step import HalfBackend
from kvcache.backends.cpu.threads import torch_threads
from kvcache.backends.torch_step import TorchBackend

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendError",
    "HalfBackend",
    "Float32Backend",
    "TorchBackend",
    "choose_backend",
    "torch_threads",
]
