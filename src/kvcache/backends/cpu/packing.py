"""The weights of a float32 CPU model, packed once for the float32 backend.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
packing.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from kvcache.backends.cpu.huge_pages import MOVE_LIMIT, Arena, aligned, huge_pages_available
from kvcache.model.heap import release_freed_memory


@dataclass
class LayerWeights:
    """One decoder layer for the step; every matrix as (in, out), so a projection of rows
    x (B, in) is `x @ matrix`."""

    norm1: np.ndarray  # (hidden,)
    qkv: np.ndarray  # (hidden, (H + 2·H_kv)·D)
    qkv_bias: np.ndarray | None
    o: np.ndarray  # (H·D, hidden)
    o_bias: np.ndarray | None
    norm2: np.ndarray  # (hidden,)
    gate_up: np.ndarray  # (hidden, 2·inner): gate columns, then up
    gate_up_bias: np.ndarray | None
    down: np.ndarray  # (inner, hidden)
    down_bias: np.ndarray | None
    q_norm: np.ndarray | None = None  # (D,) per-head RMSNorm of queries before RoPE (qwen3)
    k_norm: np.ndarray | None = None  # (D,) and of keys


@dataclass
class PackedWeights:
    """Every weight the step reads, and the parameters they came from (to tell later whether the
    model still reads this memory)."""

    layers: list[LayerWeights]
    embed: np.ndarray  # (vocab, hidden)
    final_norm: np.ndarray  # (hidden,)
    lm_head: np.ndarray  # (hidden, vocab)
    on_huge_pages: bool
    sources: list[tuple[torch.Tensor, int]]  # (parameter, its data pointer after packing)

    def matches(self, model: nn.Module) -> bool:
        """Whether `model`'s parameters are still the ones packed, reading the packed memory
        (none replaced, moved or cast since)."""
        parameters = list(model.parameters())
        return len(parameters) == len(self.sources) and all(
            parameter is source and parameter.data_ptr() == pointer
            for parameter, (source, pointer) in zip(parameters, self.sources)
        )


class _Packer:
    """Makes the step's arrays from parameters, in the model's order, from an arena of huge
    pages (every array copied there) or from ordinary memory (only re-laid-out arrays copied)."""

    def __init__(self, arena: Arena | None) -> None:
        self.arena = arena

    def _new(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.arena.array(shape) if self.arena is not None else np.empty(shape, np.float32)

    def vector(self, parameter: nn.Parameter | None) -> np.ndarray | None:
        """A norm weight or bias (n,), copied into the arena when there is one."""
        if parameter is None:
            return None
        return self.matrices([parameter])

    def matrices(self, parameters: list[nn.Parameter]) -> np.ndarray:
        """The (out_i, in) weights (or (n_i,) biases) of `parameters`, stacked along out, as
        (in, sum out) for a product (biases: (sum n,)). Each parameter is pointed at its slice
        where the memory is new."""
        tensors = [parameter.detach() for parameter in parameters]
        rows = sum(tensor.shape[0] for tensor in tensors)
        rest = tuple(tensors[0].shape[1:])
        if len(tensors) == 1 and self.arena is None and tensors[0].is_contiguous():
            array = tensors[0].numpy()  # already laid out: a view, nothing moves
            return array.T if array.ndim == 2 else array
        packed = stacked = self._new((rows, *rest))  # (sum out, in) or (sum n,)
        start = 0
        with torch.no_grad():
            for parameter, tensor in zip(parameters, tensors):
                count = tensor.shape[0]
                view = stacked[start : start + count]
                view[...] = tensor.numpy()
                parameter.data = torch.from_numpy(view)  # same values and shape, packed memory
                start += count
        return packed if packed.ndim == 1 else packed.T


def _layout_bytes(model) -> int:
    """Bytes of every array the step reads (each aligned), for sizing an arena."""
    seen: set[int] = set()
    total = 0
    for parameter in model.parameters():
        if id(parameter) not in seen:
            seen.add(id(parameter))
            total += aligned(parameter.numel() * 4)
    return total


def pack_weights(model) -> PackedWeights:
    """Pack a float32 CPU LlamaForCausalLM's weights for the float32 step (see the module
    docstring), row-major: each output one contiguous row, as numba's kernels read them; its
    parameters are pointed at the packed memory where it is new."""
    total = _layout_bytes(model)
    arena = Arena(total) if huge_pages_available() and total <= MOVE_LIMIT else None
    packer = _Packer(arena)
    decoder = model.model
    embed = packer.matrices([decoder.embed_tokens.weight]).T  # (vocab, hidden)
    layers = []

    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        gate_up = [mlp.gate_proj, mlp.up_proj]
        layers.append(
            LayerWeights(
                norm1=packer.vector(layer.input_layernorm.weight),
                qkv=packer.matrices([p.weight for p in projections]),
                qkv_bias=_biases(packer, projections),
                o=packer.matrices([attn.o_proj.weight]),
                o_bias=packer.vector(attn.o_proj.bias),
                norm2=packer.vector(layer.post_attention_layernorm.weight),
                gate_up=packer.matrices([p.weight for p in gate_up]),
                gate_up_bias=_biases(packer, gate_up),
                down=packer.matrices([mlp.down_proj.weight]),
                down_bias=packer.vector(mlp.down_proj.bias),
                q_norm=packer.vector(attn.q_norm.weight) if attn.qk_norm == "head" else None,
                k_norm=packer.vector(attn.k_norm.weight) if attn.qk_norm == "head" else None,
            )
        )
        release_freed_memory()  # the replaced storages leave resident memory layer by layer
    final_norm = packer.vector(decoder.norm.weight)
    head = model.lm_head
    if head.weight is decoder.embed_tokens.weight:  # tied: the embedding, read as (hidden, vocab)
        lm_head = embed.T
    else:
        lm_head = packer.matrices([head.weight])
    release_freed_memory()
    sources = [(parameter, parameter.data_ptr()) for parameter in model.parameters()]
    assert final_norm is not None
    return PackedWeights(layers, embed, final_norm, lm_head, arena is not None, sources)


def _biases(packer: _Packer, linears: list[nn.Linear]) -> np.ndarray | None:
    """The linears' biases stacked (sum out,), or None when they have none."""
    biases = [linear.bias for linear in linears]
    if all(bias is None for bias in biases):
        return None
    if any(bias is None for bias in biases):
        raise ValueError("cannot fuse projections of which only some have a bias")
    return packer.matrices(biases)
