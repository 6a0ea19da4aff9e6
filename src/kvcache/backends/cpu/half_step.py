"""HalfBackend: the decode step of a bfloat16 or float16 CPU Llama-family model.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
half_step.py.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.backends.base import BackendError
from kvcache.backends.cpu import huge_pages, numba_products, onednn
from kvcache.backends.cpu.cpu_backend import CpuBackend
from kvcache.backends.cpu.onednn import LaidOutLayer, LaidOutProduct, laid_out_product, product
from kvcache.backends.cpu.support import (
    require,
    unsupported_kernels,
    unsupported_parameters,
    unsupported_structure,
)

HALF_DTYPES = (torch.bfloat16, torch.float16)


def unsupported(model) -> str | None:
    """Why the half step cannot stand in for `model`'s decode forward, or None when it can."""
    reason = unsupported_structure(model, "the half step") or unsupported_parameters(
        model, HALF_DTYPES, "the half step"
    )
    if reason is None and model.dtype == torch.bfloat16 and not onednn.available():
        reason = "this torch build has no oneDNN (mkldnn), whose bfloat16 products the half step uses"
    return reason or unsupported_kernels()


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the half step can stand in for `model`."""
    require(unsupported(model), "the half backend")


class HalfBackend(CpuBackend):
    """Decode steps of a bfloat16 or float16 CPU LlamaForCausalLM on weights laid out once (see
    the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "half"

    def __init__(self, model) -> None:
        require_supported(model)
        with torch.inference_mode(False):  # the kernels read the parameters in place: onto 2 MB
            huge_pages.move_parameters(model)  # pages (a copy, once)
        super().__init__(model)
        self.dtype = model.dtype
        with torch.inference_mode(False), torch.no_grad():
            self.layers = [LaidOutLayer(layer) for layer in model.model.layers]
            self.embed = model.model.embed_tokens.weight.detach()  # the model's own: rows are read
            self._embed_bits = numba_products.half_bits(self.embed.contiguous())  # (a view)
            self.final_norm = model.model.norm.weight.detach().float().numpy()
            self._head = laid_out_product(model.lm_head)
            self.lm_head = self._head.weight
        self.remember_parameters(model)
        row_layers = kernel_layers(self.layers, self._head, self.dtype)
        if row_layers is None:
            raise BackendError("the half backend reads the weights in place: every one must be contiguous")
        self.row_layers = row_layers
        # several rows: oneDNN's bfloat16 product reads its weight once for all of them at about
        # one row's cost, where the kernels' costs grow with the rows; float16's product for many
        # rows (F.linear) is slower than the kernels at any count (docs/backends.md)
        self.kernel_rows = 1 if self.dtype == torch.bfloat16 else 1 << 30

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config, every parameter
        the one it copied, in place and unwritten since (its version counter), every buffer the
        one it read."""
        return self.same_model_config(model) and self.same_parameters(model)

    def _linear(self, x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
        """x (B, in) float32, rounded to the weights' dtype, through oneDNN's packed bfloat16
        product or float16 `F.linear` (`onednn.product`), read back as float32 (B, out)."""
        return product(x, weight, bias, self.dtype)

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The rows of token_ids (B,) widened to float32 (B, hidden), in numpy from the table's
        bits (no torch call)."""
        rows = self._embed_bits[token_ids]  # (B, hidden) bits, a copy
        if self.dtype == torch.bfloat16:
            return (rows.astype(np.uint32) << 16).view(np.float32)
        return rows.view(np.float16).astype(np.float32)


def kernel_layers(layers: list[LaidOutLayer], head: LaidOutProduct, dtype: torch.dtype) -> tuple | None:
    """The laid-out layers and lm_head as numba's kernels read them (`CpuBackend.row_layers`),
    each product's parts its members' own parameters (the model's memory) viewed as their bits
    (`numba_products.half_bits`); None when a weight cannot be viewed so (not contiguous)."""

    def parts(laid: LaidOutProduct) -> tuple[tuple, np.ndarray | None] | None:
        bits = tuple(numba_products.half_bits(member.weight) for member in laid.members)
        if any(part is None for part in bits):
            return None
        return bits, None if laid.bias is None else laid.bias.float().numpy()

    row_layers = []
    for layer in layers:
        products = [parts(product) for product in layer.products]
        if any(product is None for product in products):
            return None
        row_layers.append(numba_products.RowLayer.of(layer, products))
    lm_head = parts(head)
    if lm_head is None:
        return None
    return row_layers, numba_products.row_product(*lm_head), numba_products.rounding_of(dtype)
