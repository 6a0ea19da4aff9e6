"""HalfBackend: the decode step of a bfloat16 or float16 CPU Llama-family model.

Why: a decode step reads every weight once, so on CPU it is bound by memory bandwidth, and
half-precision weights halve the bytes a token costs. torch's own half-precision products at one
row are slow to read their weights on the CPUs measured (bfloat16 `F.linear` re-lays its weight
out for oneDNN on every call), so the step keeps its own copy of the weights laid out once:
bfloat16 matrices in oneDNN's packed layout (`onednn`: its products read each weight once
whatever the number of rows and accumulate in float32), float16 ones as plain matrices for
`F.linear`. q/k/v and gate/up are fused into one matrix each, so a layer is four products. A
bfloat16 model's prompt forward runs its products on the same copy (`prompt_products`). One row
of a bfloat16 model on a cache of fewer than `LONG` tokens runs numba's matrix-vector loop
instead (`numba_products`: faster in the step than oneDNN's on the CPU measured), on the model's
own parameters read in place (q, k, v and gate, up one after another), its input and output
rounded to bfloat16 as oneDNN's are; where numba has no fast pool (or a weight's width is odd)
oneDNN's runs every step.

The step computes the model's forward: RMSNorm, fused q/k/v, the per-head q/k norms (qwen3),
RoPE, the cache update, grouped-query attention under the plan's masks, o_proj, RMSNorm, SwiGLU,
residuals, the final norm and lm_head: the arithmetic between products is `array_step.ArrayStep`'s,
on numpy float32 rows, so what the torch forward does in the weights' dtype it does in float32
(the residual stream, the norms, RoPE, SiLU); each product's input is rounded to the weights'
dtype and its output read back in float32; keys and values are stored in the cache's dtype and
attention runs there. So its logits are as close to a float32 forward of the same weights as the
torch forward's in that dtype (the tests pin a mean error within 1.25× and a worst within 2× of
the torch forward's).

Like the numpy step it calls no module (`support.unsupported_structure`), and its copy of the
weights is the model's at build time: `matches` says whether every parameter is still the same
tensor, unchanged (its version counter), so a model written to since gets a new backend.
"""

from __future__ import annotations

import numpy as np
import torch

from kvcache.backends import numba_products, onednn
from kvcache.backends.array_step import ArrayStep
from kvcache.backends.base import BackendError
from kvcache.backends.onednn import LaidOutLayer, laid_out_product, product
from kvcache.backends.prompt_products import LaidOutProduct, PromptProducts
from kvcache.backends.support import unsupported_parameters, unsupported_structure

HALF_DTYPES = (torch.bfloat16, torch.float16)
#: cached tokens from which a one-row bfloat16 step runs oneDNN's products on torch's threads
#: rather than numba's: a numba step runs torch (its attention) on one thread, and bfloat16
#: attention over a long cache gained more from torch's second thread than numba's products
#: gained over oneDNN's; the two were level at about this length (`docs/backends.md`)
LONG = 1024


def unsupported(model) -> str | None:
    """Why the half step cannot stand in for `model`'s decode forward, or None when it can."""
    reason = unsupported_structure(model, "the half step") or unsupported_parameters(
        model, HALF_DTYPES, "the half step"
    )
    if reason is None and model.dtype == torch.bfloat16 and not onednn.available():
        reason = "this torch build has no oneDNN (mkldnn), whose bfloat16 products the half step uses"
    return reason


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the half step can stand in for `model`."""
    reason = unsupported(model)
    if reason is not None:
        raise BackendError(f"the half backend cannot run this model: {reason}; use the torch backend")


class HalfBackend(ArrayStep):
    """Decode steps of a bfloat16 or float16 CPU LlamaForCausalLM on weights laid out once (see
    the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "half"

    def __init__(self, model) -> None:
        require_supported(model)
        super().__init__(model)
        self.dtype = model.dtype
        with torch.inference_mode(False), torch.no_grad():
            self.layers = [LaidOutLayer(layer) for layer in model.model.layers]
            self.embed = model.model.embed_tokens.weight.detach()  # the model's own: rows are read
            self.final_norm = model.model.norm.weight.detach().float().numpy()
            self._head = laid_out_product(model.lm_head)
            self.lm_head = self._head.weight
        self._sources = [(p, p.data_ptr(), p._version) for p in model.parameters()]
        # one row of a bfloat16 model: numba's products on the model's own parameters
        self._pairs: tuple[list, _Pairs] | None = None
        if self.dtype == torch.bfloat16 and numba_products.available():
            layers = [_PairsLayer(layer) for layer in self.layers]
            head = _Pairs.of(self._head)
            if head is not None and all(layer.complete for layer in layers):
                self._pairs = layers, head
        self._numba = self._pairs is not None

    def _numba_step(self, batch: int, past: int) -> bool:
        """numba's products: one row of a bfloat16 model on a cache of fewer than LONG tokens."""
        return self._pairs is not None and batch == 1 and past < LONG

    def _on_torch_threads(self, batch: int, past: int = 0) -> bool:
        """A numba step's products run on numba's threads; the rest on torch's."""
        return not self._numba_step(batch, past)

    def _products(self, batch: int, past: int = 0):
        """numba's products on the model's bfloat16 parameters for a numba step (`_numba_step`);
        oneDNN's (float16: F.linear's) on the laid-out copy otherwise."""
        if not self._numba_step(batch, past):
            return self.layers, self.lm_head, self._linear
        layers, head = self._pairs
        return layers, head, _Pairs.linear

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config, every parameter
        the one it copied, in place and unwritten since (its version counter), every buffer the
        one it read."""
        parameters = list(model.parameters())
        return (
            self.same_model_config(model)
            and len(parameters) == len(self._sources)
            and all(p is mine and p.data_ptr() == ptr and p._version == version
                    for p, (mine, ptr, version) in zip(parameters, self._sources))
        )

    def prompt_products(self):
        """A bfloat16 model's prompt runs its products on the step's packed copy
        (`prompt_products`); a float16 one's on torch's (float16 copies are not packed)."""
        if self.dtype not in onednn.PACKED_DTYPES:
            return super().prompt_products()
        return PromptProducts.of_layers(self.layers, self._head)

    def _linear(self, x: np.ndarray, weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
        """x (B, in) float32, rounded to the weights' dtype, through oneDNN's packed bfloat16
        product or float16 `F.linear` (`onednn.product`), read back as float32 (B, out)."""
        return product(x, weight, bias, self.dtype)

    def _embed(self, token_ids: np.ndarray) -> np.ndarray:
        return self.embed[torch.from_numpy(token_ids)].float().numpy()  # (B, hidden)

    def _store(self, cache, k, v, index):
        return cache.update(torch.from_numpy(k).to(self.dtype), torch.from_numpy(v).to(self.dtype), index)


class _Pairs:
    """A laid-out product's member weights as the model's own bfloat16 parameters, viewed as
    uint32 pairs (`numba_products.bfloat16_pairs`, no copy), and its fused bias in float32."""

    def __init__(self, parts: list[np.ndarray], bias: np.ndarray | None) -> None:
        self.parts = tuple(parts)
        self.bias = bias

    @classmethod
    def of(cls, laid: LaidOutProduct) -> _Pairs | None:
        """From a `LaidOutProduct`'s members; None when a weight cannot be viewed as pairs."""
        parts = [numba_products.bfloat16_pairs(member.weight) for member in laid.members]
        if any(part is None for part in parts):
            return None
        bias = None if laid.bias is None else laid.bias.float().numpy()
        return cls(parts, bias)

    @staticmethod
    def linear(x: np.ndarray, weight: _Pairs, bias) -> np.ndarray:
        """x (1, in) float32 through `weight`'s members (+ its bias; the step's `bias` argument
        is None) -> (1, out) float32, in one numba call that rounds the input and the output to
        bfloat16 as oneDNN's bfloat16 product (and torch's) rounds them."""
        return numba_products.product_bfloat16(x[0], weight.parts, weight.bias)[None]


class _PairsLayer:
    """A `LaidOutLayer`'s norms, with its four products as `_Pairs` (`complete`: all of them)."""

    def __init__(self, laid: LaidOutLayer) -> None:
        self.norm1, self.norm2, self.q_norm, self.k_norm = laid.norm1, laid.norm2, laid.q_norm, laid.k_norm
        pairs = [_Pairs.of(product) for product in laid.products]
        self.complete = all(p is not None for p in pairs)
        self.qkv, self.o, self.gate_up, self.down = pairs
        self.qkv_bias = self.o_bias = self.gate_up_bias = self.down_bias = None  # (in each _Pairs)
