"""Decode backends: one step of B rows (one new token each, ragged lengths) built from a model.

    backend = choose_backend(model)            # "auto": numpy (fp32 CPU), half (bf16/fp16), torch
    logits = backend.decode(input_ids, cache)  # (B, 1) -> (B, vocab), through cache.begin/update

`TorchBackend` runs the model's forward; `NumpyBackend` runs the same computation for float32
weights packed once (fused q/k/v and gate/up, on 2 MB pages), one row on numba's compiled kernels
and several as numpy calls; `HalfBackend` runs it for bfloat16/float16 weights, one row on the
same kernels reading the model's parameters in place and several on its own copy laid out once
for oneDNN's half-precision products. The model knows none of them.
"""

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.choice import BACKENDS, choose_backend
from kvcache.backends.cpu.half_step import HalfBackend
from kvcache.backends.cpu.numpy_step import NumpyBackend
from kvcache.backends.cpu.threads import torch_threads
from kvcache.backends.torch_step import TorchBackend

__all__ = [
    "BACKENDS",
    "BackendError",
    "DecodeBackend",
    "HalfBackend",
    "NumpyBackend",
    "TorchBackend",
    "choose_backend",
    "torch_threads",
]
