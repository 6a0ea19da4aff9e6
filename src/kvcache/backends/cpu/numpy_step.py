"""NumpyBackend: the decode step of a float32 CPU Llama-family model, one row on numba's kernels.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
numpy_step.py.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.backends.base import BackendError
from kvcache.backends.cpu import numba_products, onednn
from kvcache.backends.cpu.array_step import ArrayStep
from kvcache.backends.cpu.packing import pack_weights
from kvcache.backends.cpu.prompt_products import PromptProducts
from kvcache.backends.cpu.support import unsupported_parameters, unsupported_structure


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
    #: past a few rows oneDNN's float32 product (compute-bound, blocked for the cache) beats the
    #: kernels' (docs/backends.md)
    kernel_rows = 4

    def __init__(self, model) -> None:
        require_supported(model)
        super().__init__(model)
        # packed outside inference mode (a caller's, or generate's), so the model's parameters
        # stay ordinary tensors it can still train
        numba = numba_products.available()  # else numpy's (OpenBLAS) one-row products
        with torch.inference_mode(False), torch.no_grad():
            self.weights = pack_weights(model, column_major_tall=not numba)
        self.layers = self.weights.layers
        self.final_norm = self.weights.final_norm
        self.lm_head = self.weights.lm_head
        if numba:  # the kernels read the same row-major arrays: (out, in) is (in, out).T
            self.row_layers = [
                numba_products.RowLayer.of(w, [
                    ((w.qkv.T,), w.qkv_bias), ((w.o.T,), w.o_bias),
                    ((w.gate_up.T,), w.gate_up_bias), ((w.down.T,), w.down_bias),
                ]) for w in self.layers
            ], numba_products.row_product((self.lm_head.T,), None), numba_products.rounding_of(torch.float32)
        # oneDNN's copy (steps of several rows, prompts), made from the modules (which read the
        # packed arrays), and the parameters' version counters it was made at
        self._modules = list(model.model.layers), model.lm_head
        self._laid_out: tuple[list, object] | None = None
        self._laid_out_versions: list[int] = []
        self._oneDNN_copy()

    def _oneDNN_copy(self) -> tuple[list, object] | None:
        """(layers, lm_head `LaidOutProduct`) in oneDNN's layout, made again when a parameter
        was written to in place since; None without oneDNN."""
        if not onednn.available():
            return None
        versions = [parameter._version for parameter, _ in self.weights.sources]
        if self._laid_out is None or versions != self._laid_out_versions:  # none yet, or stale
            layers, head = self._modules
            with torch.inference_mode(False), torch.no_grad():
                laid_out_layers = [onednn.LaidOutLayer(layer) for layer in layers]
                self._laid_out = laid_out_layers, onednn.laid_out_product(head)
            self._laid_out_versions = versions
        return self._laid_out

    def products(self, batch: int):
        """Numpy's products for one row (numba's kernels run their own); oneDNN's on its copy
        for several."""
        copy = self._oneDNN_copy() if batch > 1 else None
        if copy is None:
            return self.layers, self.lm_head, self._linear
        layers, head = copy
        return layers, head.weight, self._linear_rows

    def prompt_products(self):
        """A prompt's products on oneDNN's copy (`prompt_products`), when there is one."""
        copy = self._oneDNN_copy()
        if copy is None:
            return super().prompt_products()
        layers, head = copy
        return PromptProducts.of_layers(layers, head)

    def _on_torch_threads(self, batch: int) -> bool:
        """Several rows run on oneDNN (torch's threads); one on numba's kernels or OpenBLAS's."""
        return batch > 1 and onednn.available()

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config and eps, every
        parameter still the packed one (see `PackedWeights.matches`), every buffer (the RoPE
        frequencies) the one it read. An in-place write to a buffer is not seen."""
        return self.same_model_config(model) and self.weights.matches(model)

    def _linear(self, x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """x (B, in) @ weight (in, out) (+ bias) -> (B, out): numpy's product."""
        out = x @ weight
        if bias is not None:
            out += bias
        return out

    @staticmethod
    def _linear_rows(x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
        """x (B, in) through oneDNN's packed float32 product -> (B, out)."""
        return onednn.product(x, weight, bias, torch.float32)

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        return self.weights.embed[token_ids]  # (B, hidden), a copy

    def _store(self, cache, k, v, index):
        keys, values = cache.update_arrays(k, v, index)  # numpy (B, H_kv, T_kv, D)
        return torch.from_numpy(keys), torch.from_numpy(values)

    def _store_rows(self, cache, k, v, index):
        return cache.update_arrays(k, v, index)  # numpy (1, H_kv, T_kv, D) float32
