"""Decode backends: one step of B rows (one new token each, ragged lengths) built from a model.

    backend = choose_backend(model)            # "auto": numpy (fp32 CPU), half (bf16/fp16), torch
    logits = backend.decode(input_ids, cache)  # (B, 1) -> (B, vocab), through cache.begin/update

`TorchBackend` runs the model's forward; `NumpyBackend` runs the same computation in numpy on
weights packed once (fused q/k/v and gate/up, tall matrices column-major, small models on 2 MB
pages); `HalfBackend` runs it for bfloat16/float16 weights on its own copy of them, laid out once
for torch's half-precision products. The model knows none of them.
"""

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.choice import BACKENDS, choose_backend
from kvcache.backends.half_step import HalfBackend
from kvcache.backends.numpy_step import NumpyBackend
from kvcache.backends.threads import torch_threads
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
