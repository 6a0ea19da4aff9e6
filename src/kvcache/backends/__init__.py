"""Decode backends: one step of B rows (one new token each, ragged lengths) built from a model.

    backend = choose_backend(model)            # "auto": numpy on float32 CPU, else torch
    logits = backend.decode(input_ids, cache)  # (B, 1) -> (B, vocab), through cache.begin/update

`TorchBackend` runs the model's forward; `NumpyBackend` runs the same computation in numpy on
weights packed once (fused q/k/v and gate/up, tall matrices column-major, small models on 2 MB
pages). The model knows nothing of either.
"""

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.choice import BACKENDS, choose_backend
from kvcache.backends.numpy_step import NumpyBackend
from kvcache.backends.threads import torch_threads
from kvcache.backends.torch_step import TorchBackend

__all__ = [
    "BACKENDS",
    "BackendError",
    "DecodeBackend",
    "NumpyBackend",
    "TorchBackend",
    "choose_backend",
    "torch_threads",
]
