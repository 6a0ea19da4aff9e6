"""A step's weights laid out once for oneDNN's products (`torch.ops.mkldnn`), and the product.

Why: oneDNN's packed product reads each weight once whatever the number of rows and accumulates
in float32, where the BLAS products a step could otherwise call re-read or re-lay their weights
out: torch's bfloat16 `F.linear` re-lays its weight out for oneDNN on every call, and OpenBLAS's
float32 product of a few rows (a matrix-matrix product) packs its weight on every call, so it
costs about twice its one-row matrix-vector product, which reads the weight once
(`docs/backends.md`). The half step's products are these for bfloat16 weights (float16 ones stay
plain for `F.linear`: packing them needs AVX512-FP16), and the numpy step's are these for steps
of two rows or more.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

#: weight dtypes oneDNN's packed product takes on the CPUs measured
PACKED_DTYPES = (torch.float32, torch.bfloat16)
#: the row count oneDNN is told to pack for: for float32 weights the layout it picks for one row
#: read slower than the one for a few rows at every row count measured (1 to 16); for bfloat16
#: the hint made no difference
PACKED_FOR_ROWS = 4


def available() -> bool:
    """Whether this torch build has oneDNN (mkldnn), whose packed products this module uses."""
    return torch.backends.mkldnn.is_available()


def laid_out(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight as `product` reads it: float32 and bfloat16 in oneDNN's packed layout
    (a copy), float16 as a plain contiguous matrix."""
    weight = weight.detach()
    if weight.dtype in PACKED_DTYPES:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACKED_FOR_ROWS)
    return weight.contiguous()


def product(x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> np.ndarray:
    """x (B, in) float32, rounded to the weights' `dtype`, times weightᵀ (+ bias (out,)), read back
    as float32 (B, out); `weight` is one `laid_out` returned."""
    rows = torch.from_numpy(x)
    if dtype != torch.float32:
        rows = rows.to(dtype)
    if dtype in PACKED_DTYPES:
        out = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
    else:
        out = F.linear(rows, weight, bias)
    return out.float().numpy()


def _vector(values) -> np.ndarray | None:
    """A norm weight (a tensor or an array) as a float32 array (None stays None)."""
    if values is None or isinstance(values, np.ndarray):
        return values
    return values.detach().float().numpy()


class LaidOutLayer:
    """One decoder layer as `array_step.ArrayStep` reads it (norm1, norm2, q_norm, k_norm as float32
    arrays or None; qkv, o, gate_up, down `laid_out`, each with its bias or None), from the
    layer's weights as (out, in) tensors: `products` maps "qkv", "o", "gate_up", "down" to
    (weight, bias), the fused ones already stacked along out."""

    def __init__(self, norms: dict, products: dict) -> None:
        self.norm1 = _vector(norms["norm1"])
        self.norm2 = _vector(norms["norm2"])
        self.q_norm = _vector(norms.get("q_norm"))
        self.k_norm = _vector(norms.get("k_norm"))
        for name in ("qkv", "o", "gate_up", "down"):
            weight, bias = products[name]
            setattr(self, name, laid_out(weight))
            setattr(self, f"{name}_bias", None if bias is None else bias.detach().clone())

    @classmethod
    def of_module(cls, layer) -> LaidOutLayer:
        """From a model's DecoderLayer (q/k/v and gate/up fused here)."""
        attention, mlp = layer.self_attn, layer.mlp
        heads = attention.qk_norm == "head"
        norms = dict(
            norm1=layer.input_layernorm.weight, norm2=layer.post_attention_layernorm.weight,
            q_norm=attention.q_norm.weight if heads else None,
            k_norm=attention.k_norm.weight if heads else None,
        )
        return cls(norms, dict(
            qkv=_stacked(attention.q_proj, attention.k_proj, attention.v_proj),
            o=_stacked(attention.o_proj),
            gate_up=_stacked(mlp.gate_proj, mlp.up_proj),
            down=_stacked(mlp.down_proj),
        ))

    @classmethod
    def of_arrays(cls, packed) -> LaidOutLayer:
        """From the numpy step's `packing.LayerWeights` (matrices (in, out), already fused)."""
        def pair(matrix: np.ndarray, bias: np.ndarray | None):
            return torch.from_numpy(matrix.T), None if bias is None else torch.from_numpy(bias)

        norms = dict(norm1=packed.norm1, norm2=packed.norm2, q_norm=packed.q_norm, k_norm=packed.k_norm)
        return cls(norms, dict(
            qkv=pair(packed.qkv, packed.qkv_bias), o=pair(packed.o, packed.o_bias),
            gate_up=pair(packed.gate_up, packed.gate_up_bias), down=pair(packed.down, packed.down_bias),
        ))


def _stacked(*linears) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of `linears` stacked along out, and their biases (None when they have none)."""
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    return weight, None if biases[0] is None else torch.cat(biases)
