"""NumpyBackend: the decode step of a float32 CPU Llama-family model, its products in numpy.

Why: a decode step reads every weight once, so on CPU its products are bound by memory
bandwidth, and numpy's OpenBLAS matrix-vector product reads float32 weights faster than torch's
MKL one on the machines measured (`docs/backends.md`). So the step (`array_step.ArrayStep`: the
arithmetic between products on numpy rows) runs its products as `x @ W` on weights packed once
when the backend is built (`packing`: fused q/k/v and gate/up, tall matrices column-major), and
talks to the cache through its numpy form, `K, V = cache.update_arrays(k, v, layer_idx)`.
torch runs on one thread during the step (its attention and the cache's calls), so no OpenMP
pool spins beside OpenBLAS's threads.

A model changed after the backend was built needs a new backend (`PackedWeights.matches`).
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.backends.array_step import ArrayStep
from kvcache.backends.base import BackendError
from kvcache.backends.packing import pack_weights
from kvcache.backends.support import unsupported_parameters, unsupported_structure


def unsupported(model) -> str | None:
    """Why the numpy step cannot stand in for `model`'s decode forward, or None when it can."""
    return unsupported_structure(model, "the numpy step") or unsupported_parameters(
        model, (torch.float32,), "the numpy step"
    )


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the numpy step can stand in for `model`."""
    reason = unsupported(model)
    if reason is not None:
        raise BackendError(f"the numpy backend cannot run this model: {reason}; use the torch backend")


class NumpyBackend(ArrayStep):
    """Decode steps of a float32 CPU LlamaForCausalLM with numpy products, on weights packed
    once (see the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "numpy"
    step_threads = 1  # the cache's and attention's torch calls: no OpenMP pool beside OpenBLAS

    def __init__(self, model) -> None:
        require_supported(model)
        super().__init__(model)
        # packed outside inference mode (a caller's, or generate's), so the model's parameters
        # stay ordinary tensors it can still train
        with torch.inference_mode(False), torch.no_grad():
            self.weights = pack_weights(model)
        self.layers = self.weights.layers
        self.final_norm = self.weights.final_norm
        self.lm_head = self.weights.lm_head

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config and eps, every
        parameter still the packed one (see `PackedWeights.matches`), every buffer (the RoPE
        frequencies) the one it read. An in-place write to a buffer is not seen."""
        return self.same_model_config(model) and self.weights.matches(model)

    def _linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """x (B, in) @ weight (in, out) (+ bias) -> (B, out); for one row numpy runs OpenBLAS's
        matrix-vector product."""
        out = x @ weight
        if bias is not None:
            out += bias
        return out

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.weights.embed[token_ids]  # (B, hidden), a copy

    def _store(self, cache, k, v, index):
        keys, values = cache.update_arrays(k, v, index)  # numpy (B, H_kv, T_kv, D)
        return torch.from_numpy(keys), torch.from_numpy(values)
