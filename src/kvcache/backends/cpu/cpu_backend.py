"""CpuBackend: a decode step whose per-token arithmetic runs on numpy float32 rows.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
cpu_backend.py.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvcache.backends.base import Backend
from kvcache.backends.cpu import paged_step


class CpuBackend(Backend):
    """The step's arithmetic on numpy rows and numba's kernels (see the module docstring). A
    subclass sets `layers` (each with norm1, norm2, q_norm, k_norm as float32 arrays or None, and
    the products' weights qkv, o, gate_up, down with their biases), `row_layers`, `final_norm`
    and `lm_head`, and implements `_linear` and `embed_rows`."""

    layers: list
    final_norm: np.ndarray
    lm_head: object

    def __init__(self, model) -> None:
        config = model.config
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.group = self.heads // self.kv_heads
        self.eps = float(model.model.norm.eps)  # every RMSNorm's (unsupported_structure checked)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.vocab = model.model.embed_tokens.num_embeddings  # the ids an embedding row exists for
        self.rotary = model.model.rotary_emb  # its table is built from the model's own frequencies
        empty = np.zeros((0, self.head_dim), np.float32)
        self._cos, self._signed_sin = empty, empty  # the RoPE table, grown on demand
        self._buffers = [(buffer, buffer.data_ptr()) for buffer in model.buffers()]

    def same_model_config(self, model) -> bool:
        """Whether `model` has the config and eps this step was built for, and every buffer (the
        RoPE frequencies) is still the one it read (an in-place write to one is not seen)."""
        buffers = list(model.buffers())
        return (
            model.config == self.config
            and float(model.model.norm.eps) == self.eps
            and len(buffers) == len(self._buffers)
            and all(b is mine and b.data_ptr() == ptr for b, (mine, ptr) in zip(buffers, self._buffers))
        )

    def remember_parameters(self, model) -> None:
        """Note `model`'s parameters as they are now: each one, its memory and its version
        counter (`same_parameters` compares against them)."""
        self._sources = [(p, p.data_ptr(), p._version) for p in model.parameters()]

    def same_parameters(self, model) -> bool:
        """Whether every parameter of `model` is the one `remember_parameters` noted, in place
        and unwritten since."""
        parameters = list(model.parameters())
        return len(parameters) == len(self._sources) and all(
            p is mine and p.data_ptr() == ptr and p._version == version
            for p, (mine, ptr, version) in zip(parameters, self._sources)
        )

    # ---- what a backend supplies ----------------------------------------------------------------
    def products(self, batch: int) -> tuple[list, object, object]:
        """(layers, lm_head, linear) for the products of a step of `batch` tokens that runs them
        off the kernels (`paged_step`): here always the backend's own `layers`, `lm_head` and
        `_linear`."""
        return self.layers, self.lm_head, self._linear

    #: (layers as `numba_products.RowLayer`, lm_head as (parts, bias), what their products round
    #: to: `numba_products.rounding_of`): the weights as numba's kernels read them, set by every
    #: subclass
    row_layers: tuple[list, tuple, int]

    def _linear(self, x: np.ndarray, weight, bias) -> np.ndarray:
        """x (N, in) float32 through one of the step's products -> (N, out) float32."""
        raise NotImplementedError

    def embed_rows(self, token_ids: np.ndarray) -> np.ndarray:
        """The embedding rows of token_ids (N,) as a new float32 array (N, hidden)."""
        raise NotImplementedError

    # ---- RoPE --------------------------------------------------------------------------------
    def _extend_rope_table(self, needed: int) -> None:
        """cos and signed sin (N, D) of positions 0..N-1 for N >= needed (doubling), from the
        model's own RotaryEmbedding. Its range check (dynamic scaling stops at
        max_position_embeddings) applies: the table never grows past that limit, and a position
        beyond it raises as on the torch path."""
        size = max(needed, 2 * len(self._cos), 256)
        if self.rotary.limit is not None:
            size = max(needed, min(size, self.rotary.limit))
        cos, signed_sin = self.rotary(torch.arange(size)[None], torch.float32)  # (1, 1, N, D)
        self._cos, self._signed_sin = cos[0, 0].numpy(), signed_sin[0, 0].numpy()

    # ---- the step ------------------------------------------------------------------------------
    #: a step of up to this many tokens runs every product on numba's kernels (`paged_step`);
    #: more, on `products`
    kernel_rows: int = 16

    def step(self, model, batch) -> torch.Tensor:
        """One step (`Backend.step`) on numba's kernels, reading and writing the paged blocks in
        place (`paged_step`)."""
        return paged_step.run(self, batch)

    def rope_rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(cos, signed_sin), each (N, D) float32, of positions (N,): the model's RotaryEmbedding
        table, which every CPU step turns its queries and keys by (the kernels'
        `turned`)."""
        needed = int(positions.max()) + 1
        if needed > len(self._cos):
            self._extend_rope_table(needed)
        return self._cos[positions], self._signed_sin[positions]
