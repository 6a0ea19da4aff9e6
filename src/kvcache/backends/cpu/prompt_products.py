"""A prompt's products on a decode backend's laid-out weights (oneDNN's packed layout).

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
prompt_products.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


@dataclass(frozen=True)
class Member:
    """One module's share of a laid-out product: its parameters and the output columns
    [start, stop) of the fused matrix that are its outputs."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    start: int
    stop: int


@dataclass(frozen=True)
class LaidOutProduct:
    """A `onednn.laid_out` matrix (out, in) with its fused bias, and the modules it stands for."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype
    members: tuple[Member, ...]


class PromptProducts(TorchFunctionMode):
    """`F.linear` of any listed module's weight on its laid-out product; every other call
    unchanged (see the module docstring). `served` counts the calls the copy answered."""

    def __init__(self, products: list[LaidOutProduct]) -> None:
        super().__init__()
        self._by_weight = {
            id(member.weight): (product, member) for product in products for member in product.members
        }
        # id(member weight) -> (input, its version, the member's output) computed for it already
        self._pending: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.served = 0

    @classmethod
    def of_layers(cls, layers, head: LaidOutProduct) -> PromptProducts:
        """The mode for a model's laid-out layers (each with its `products`) and its lm_head."""
        return cls([product for layer in layers for product in layer.products] + [head])

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            found = self._by_weight.get(id(weight))
            if found is not None and self._answers(found, x, weight, bias):
                self.served += 1
                return self._output(found[0], found[1], x)
        return func(*args, **kwargs)

    @staticmethod
    def _answers(found: tuple[LaidOutProduct, Member], x, weight, bias) -> bool:
        product, member = found
        return (
            member.weight is weight
            and member.bias is bias
            and isinstance(x, torch.Tensor)
            and x.dtype == product.dtype
            and x.device.type == "cpu"
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        )

    def _output(self, product: LaidOutProduct, member: Member, x: torch.Tensor) -> torch.Tensor:
        """x (..., in) through `member`'s columns of `product` -> (..., stop - start)."""
        pending = self._pending.pop(id(member.weight), None)
        if pending is not None and pending[0] is x and pending[1] == _version_of(x):
            return pending[2]
        rows = x.reshape(-1, x.shape[-1]).contiguous()  # (N, in)
        fused = torch.ops.mkldnn._linear_pointwise(rows, product.weight, product.bias, "none", [], "")
        mine = None
        for other in product.members:
            out = fused[:, other.start : other.stop].unflatten(0, x.shape[:-1])  # (..., out_i)
            if other is member:
                mine = out
            else:
                self._pending[id(other.weight)] = (x, _version_of(x), out)
        assert mine is not None
        return mine


def _version_of(x: torch.Tensor) -> int:
    """x's version counter (in-place writes count up); an inference tensor keeps none: -1."""
    return -1 if x.is_inference() else x._version
