"""Float32Backend: the decode step of a float32 CPU Llama-family model, one row on numba's kernels.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
float32_step.py.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.backends.cpu import numba_products, onednn
from kvcache.backends.cpu.cpu_backend import CpuBackend
from kvcache.backends.cpu.packing import pack_weights
from kvcache.backends.cpu.support import (
    require,
    unsupported_kernels,
    unsupported_parameters,
    unsupported_structure,
)


def unsupported(model) -> str | None:
    """Why the float32 step cannot stand in for `model`'s decode forward, or None when it can."""
    reason = unsupported_structure(model, "the float32 step") or unsupported_parameters(
        model, (torch.float32,), "the float32 step"
    )
    return reason or unsupported_kernels()


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the float32 step can stand in for `model`."""
    require(unsupported(model), "the float32 backend")


class Float32Backend(CpuBackend):
    """Decode steps of a float32 CPU LlamaForCausalLM with numpy products, on weights packed
    once (see the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "float32"
    #: past a few rows oneDNN's float32 product (compute-bound, blocked for the cache) beats the
    #: kernels' (docs/backends.md)
    kernel_rows = 4

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
        # the kernels read the same row-major arrays: (out, in) is (in, out).T
        self.row_layers = [
            numba_products.RowLayer.of(w, [
                ((w.qkv.T,), w.qkv_bias), ((w.o.T,), w.o_bias),
                ((w.gate_up.T,), w.gate_up_bias), ((w.down.T,), w.down_bias),
            ]) for w in self.layers
        ], numba_products.row_product((self.lm_head.T,), None), numba_products.rounding_of(torch.float32)
        # oneDNN's copy (steps of many tokens), made from the modules (which read the packed
        # arrays), and the parameters' version counters it was made at
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
        """oneDNN's products on its copy for several tokens; numpy's without oneDNN."""
        copy = self._oneDNN_copy() if batch > 1 else None
        if copy is None:
            return self.layers, self.lm_head, self._linear
        layers, head = copy
        return layers, head.weight, self._linear_rows

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
