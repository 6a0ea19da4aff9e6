"""BlockBackend: the decode step of a CPU model whose weights are kept as a GGUF file's blocks.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
block_step.py.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from kvcache.backends.base import BackendError
from kvcache.backends.cpu import numba_products
from kvcache.backends.cpu.cpu_backend import CpuBackend
from kvcache.backends.cpu.packing import LayerWeights
from kvcache.backends.cpu.support import (
    fused_products,
    require,
    unsupported_kernels,
    unsupported_parameters,
    unsupported_structure,
)
from kvcache.model.quantized import QuantizedEmbedding, QuantizedLinear, block_weights

_BLOCK_MODULES = (QuantizedLinear, QuantizedEmbedding)


def unsupported(model) -> str | None:
    """Why the block step cannot stand in for `model`'s decode forward, or None when it can."""
    reason = unsupported_structure(model, "the block step", _BLOCK_MODULES) or unsupported_parameters(
        model, (torch.float32,), "the block step"
    )
    if reason is None and not block_weights(model):
        reason = "none of its weights is kept as ggml blocks (load a GGUF file without a dtype)"
    return reason or unsupported_kernels() or _mixed_product(model)


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the block step can stand in for `model`."""
    require(unsupported(model), "the blocks backend")


def _mixed_product(model) -> str | None:
    """Why a fused product mixes linears kept as blocks with float ones (the kernels read one
    kind of part per product), or None."""
    for index, layer in enumerate(model.model.layers):
        for name, linears in fused_products(layer):
            if len({isinstance(linear, QuantizedLinear) for linear in linears}) > 1:
                return f"layer {index}'s {name} product mixes weights kept as blocks with float ones"
    return None


def _part(linear, tiles: bool) -> tuple[np.ndarray, int] | np.ndarray:
    """A linear's weight as the kernels' part: its blocks with their code (many rows' products
    on the matrix unit with `tiles`), or its float32 (out, in)."""
    if isinstance(linear, QuantizedLinear):
        return numba_products.block_part(linear.weight_blocks, tiles)
    return linear.weight.detach().contiguous().numpy()


def _product(linears, tiles: bool) -> tuple[tuple, np.ndarray | None]:
    """(parts, stacked bias float32 or None) of the linears fused along out."""
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        bias = None
    elif any(bias is None for bias in biases):
        raise BackendError("cannot fuse projections of which only some have a bias")
    else:
        bias = np.concatenate([b.detach().float().numpy() for b in biases])
    return tuple(_part(linear, tiles) for linear in linears), bias


def _reads_q8_everywhere(model) -> bool:
    """Whether every product of the step reads blocks with 8-bit activations: their kernels give
    a row the same sums alone or beside others, on the one-row dots, their 4x4 tiles or the
    matrix unit's (each row's activations quantized on their own, every block added in one
    arithmetic: `tests/backends/cpu/test_block_step.py`, `test_numba_amx.py`), so a
    step of any size is chunk-invariant (`paged_step._each_token_attention` past `kernel_rows` tokens); a
    float32 part's product is not."""
    linears = [one for layer in model.model.layers for _, fused in fused_products(layer) for one in fused]
    return all(isinstance(linear, QuantizedLinear) and linear.weight_blocks.activations == "q8"
               for linear in (*linears, model.lm_head))


def _vector(parameter: nn.Parameter | None) -> np.ndarray | None:
    return None if parameter is None else parameter.detach().float().contiguous().numpy()


class BlockBackend(CpuBackend):
    """Decode steps of a CPU LlamaForCausalLM whose projections (and embedding) are kept as ggml
    blocks (`kvcache.model.quantized`), every product on numba's kernels reading the blocks in
    place (see the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "blocks"
    #: a step of more tokens (a prompt chunk) runs the same kernels' products outside the layer
    #: calls (`_linear`); with q8 activations (`chunk_invariant`) its norms and attention on the
    #: kernels' per-token functions, else each chunk on torch's fused attention, its keys read
    #: once for all its queries (docs/backends.md, block_step.py)
    kernel_rows = 16

    def __init__(self, model, exact_prompts: bool = True) -> None:
        """exact_prompts: with q8 activations, a step of more than `kernel_rows` tokens runs each
        token's norms and attention in the layer kernels' arithmetic (chunk-invariant: the
        default; each query's keys scored one query at a time, which costs more the longer the
        prompt); False: torch's fused attention over a chunk's keys, order-free (its logits may
        part from a token-at-a-time run's in the last bits), for long prompts' speed."""
        require_supported(model)
        super().__init__(model)
        q8 = _reads_q8_everywhere(model)
        self.chunk_invariant = q8 and exact_prompts
        #: every product reads Q8 activations and the CPU has a matrix unit: products of
        #: `numba_kernels.TILE_ROWS` rows or more run on its tiles (the same sums to the bit)
        self.on_tiles = q8 and numba_products.matrix_unit() is not None
        self.layers = []
        for layer in model.model.layers:
            attention = layer.self_attn
            heads = attention.qk_norm == "head"
            (qkv, qkv_bias), (o, o_bias), (gate_up, gate_up_bias), (down, down_bias) = (
                _product(linears, self.on_tiles) for _, linears in fused_products(layer))
            self.layers.append(LayerWeights(
                _vector(layer.input_layernorm.weight), qkv, qkv_bias, o, o_bias,
                _vector(layer.post_attention_layernorm.weight), gate_up, gate_up_bias, down, down_bias,
                _vector(attention.q_norm.weight) if heads else None,
                _vector(attention.k_norm.weight) if heads else None,
            ))
        self.final_norm = _vector(model.model.norm.weight)
        self.lm_head, _ = _product((model.lm_head,), self.on_tiles)
        self.embed = model.model.embed_tokens
        self.row_layers = (
            [numba_products.RowLayer.of(w, [(w.qkv, w.qkv_bias), (w.o, w.o_bias), (w.gate_up, w.gate_up_bias),
                                            (w.down, w.down_bias)]) for w in self.layers],
            numba_products.row_product(self.lm_head, None),
            numba_products.rounding_of(torch.float32),
        )
        self.remember_parameters(model)
        self._blocks = block_weights(model)

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config, every parameter
        the one it read, in place and unwritten since, every module over the same blocks."""
        return (
            self.same_model_config(model)
            and self.same_parameters(model)
            and block_weights(model) == self._blocks
        )

    def _linear(self, x: np.ndarray, parts: tuple, bias: np.ndarray | None) -> np.ndarray:
        """x (B, in) float32 through a product's parts -> (B, out) float32, on the kernels: a
        long step's on the tiles' own kernel (`on_tiles`; the same sums as the layer kernels'),
        not through a product kernel per parts' type, each of which would load a copy of them."""
        if self.on_tiles:
            return numba_products.tiles_product(x, parts, bias)
        return numba_products.product(x, parts, bias)

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding rows of token_ids (B,) as float32 (B, hidden), dequantized when kept as
        blocks."""
        if isinstance(self.embed, QuantizedEmbedding):
            return self.embed.weight_blocks.take_rows(token_ids)
        return self.embed.weight.detach()[torch.from_numpy(token_ids)].float().numpy()
