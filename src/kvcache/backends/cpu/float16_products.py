"""Float16 models' products and attention computed in float32 on CPU, for prompts.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
float16_products.py.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

#: rows (tokens × batch) from which a float16 product or attention runs in float32
ROWS = 16


def _rows(x: torch.Tensor) -> int:
    """Rows of a (..., n) input: every position of every batch entry."""
    return x.numel() // max(1, x.shape[-1])


def _float(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None or x.dtype != torch.float16 else x.float()


class _Float32Products(TorchFunctionMode):
    """F.linear and F.scaled_dot_product_attention on float16 CPU tensors of >= ROWS rows, in
    float32, rounded back to float16; every other call unchanged."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and _wanted(args[0]):
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if weight.dtype == torch.float16:
                return F.linear(x.float(), weight.float(), _float(bias)).half()
        if func is F.scaled_dot_product_attention and _wanted(args[0]):
            query, key, value = args[:3]
            if key.dtype == torch.float16 and value.dtype == torch.float16:
                options = dict(kwargs)
                mask = options.get("attn_mask")
                if mask is not None and mask.dtype == torch.float16:
                    options["attn_mask"] = mask.float()
                return F.scaled_dot_product_attention(
                    query.float(), key.float(), value.float(), *args[3:], **options).half()
        return func(*args, **kwargs)


def _wanted(x) -> bool:
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float16 and x.device.type == "cpu"
            and _rows(x) >= ROWS)


def float32_products(model, tokens: int) -> contextlib.AbstractContextManager:
    """The context to run `model`'s forward of `tokens` new tokens (all rows) in: float16
    products and attention in float32 (see the module docstring) when the model is float16 on
    CPU and the tokens are at least ROWS, else nothing (a decode step's forward then pays no
    Python call per op)."""
    parameter = next(model.parameters(), None)
    if (tokens >= ROWS and parameter is not None and parameter.dtype == torch.float16
            and parameter.device.type == "cpu"):
        return _Float32Products()
    return contextlib.nullcontext()
