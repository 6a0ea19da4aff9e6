"""NumpyBackend: the decode step of a float32 CPU Llama-family model, computed in numpy.

Why: a decode step is one new token per row. Its weights are read once each, so on CPU the step
is memory bandwidth (large models) or per-operation overhead (small ones). numpy's OpenBLAS
matrix-vector product reads weights faster than torch's MKL one on the machines measured, and a
numpy operation on a few hundred floats costs a fraction of a torch one (`docs/backends.md`). So
the step runs the layers as a few dozen numpy calls on weights packed once when the backend is
built (`packing`), and talks to the cache through the same seam as the model in its numpy form:
`plan = cache.begin(1, attention_mask)`, then `K, V = cache.update_arrays(k, v, layer_idx)`.

It computes the model's forward: RMSNorm, fused q/k/v, RoPE (pairs i, i + D/2), the cache
update, grouped-query attention under the plan's masks (torch's fused attention on views of
the arrays: one call per layer, which beats numpy's matmul-softmax-matmul at every size
measured), o_proj, RMSNorm, SwiGLU, residuals, the final norm, lm_head; for B rows of one new
token each, every row at its own position (left padding, or a paged cache's rows of different
lengths).

It calls no module: a model whose modules would do more than their forwards (hooks, subclasses,
a replaced `forward`) is refused when the backend is built (`unsupported`), and a model changed
afterwards needs a new backend (`PackedWeights.matches`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.packing import pack_weights
from kvcache.backends.support import unsupported_parameters, unsupported_structure
from kvcache.backends.threads import torch_threads


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


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (rows, hidden) / rms(x) * weight, float32."""
    if x.shape[0] == 1:
        row = x[0]
        inverse_rms = 1.0 / math.sqrt(float(row @ row) / row.shape[0] + eps)  # a Python float
        out = x * weight
        out *= inverse_rms
        return out
    squares = np.add.reduce(x * x, axis=-1, keepdims=True)  # (rows, 1)
    squares *= 1.0 / x.shape[-1]
    squares += eps
    np.sqrt(squares, out=squares)
    out = x / squares
    out *= weight
    return out


def _linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x (rows, in) @ weight (in, out) (+ bias) -> (rows, out); for one row numpy runs OpenBLAS's
    matrix-vector product."""
    out = x @ weight
    if bias is not None:
        out += bias
    return out


class NumpyBackend(DecodeBackend):
    """Decode steps of a float32 CPU LlamaForCausalLM in numpy, on weights packed once (see the
    module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "numpy"

    def __init__(self, model) -> None:
        require_supported(model)
        config = model.config
        self.config = config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.group = self.heads // self.kv_heads
        self.eps = float(model.model.norm.eps)  # every RMSNorm's (unsupported() checked)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        # packed outside inference mode (a caller's, or generate's), so the model's parameters
        # stay ordinary tensors it can still train
        with torch.inference_mode(False), torch.no_grad():
            self.weights = pack_weights(model)
        self.rotary = model.model.rotary_emb  # its table is built from the model's own frequencies
        self._buffers = [(buffer, buffer.data_ptr()) for buffer in model.buffers()]
        diagonal = np.arange(self.head_dim)
        partner = (diagonal + self.head_dim // 2) % self.head_dim
        # where cos and signed sin go in a flattened (D, D) rotation: (i, i) and (partner(i), i)
        self._cos_at = diagonal * self.head_dim + diagonal
        self._sin_at = partner * self.head_dim + diagonal
        empty = np.zeros((0, self.head_dim), np.float32)
        self._cos, self._signed_sin = empty, empty  # the RoPE table, grown on demand

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config and eps, every
        parameter still the packed one (see `PackedWeights.matches`), every buffer (the RoPE
        frequencies) the one it read. An in-place write to a buffer is not seen."""
        buffers = list(model.buffers())
        return (
            model.config == self.config
            and float(model.model.norm.eps) == self.eps
            and self.weights.matches(model)
            and len(buffers) == len(self._buffers)
            and all(b is mine and b.data_ptr() == ptr for b, (mine, ptr) in zip(buffers, self._buffers))
        )

    # ---- RoPE --------------------------------------------------------------------------------
    def rotations(self, positions: np.ndarray | int) -> np.ndarray:
        """RoPE as matrices (B, D, D) for positions (B,), or (1, D, D) for one int position of
        every row: row vector x @ R is x turned to its position. x_i' = x_i·cos_i +
        x_{(i + D/2) mod D}·signed_sin_i, the model's `apply_rope`; one small product per layer
        (queries and keys together) replaces a roll, two products and a sum."""
        if isinstance(positions, int):  # the usual case: scalar indexing, no index array
            needed, rows = positions + 1, 1
        else:
            needed, rows = int(positions.max()) + 1, len(positions)
        if needed > len(self._cos):
            self._extend_rope_table(needed)
        rotation = np.zeros((rows, self.head_dim * self.head_dim), np.float32)  # filled as (D, D)
        rotation[:, self._cos_at] = self._cos[positions]
        rotation[:, self._sin_at] = self._signed_sin[positions]
        return rotation.reshape(rows, self.head_dim, self.head_dim)

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
    def decode(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, vocab) float32 logits of one decode step of input_ids (B, 1) on `cache` (see
        `DecodeBackend.decode`)."""
        self.check_step_ids(input_ids)
        token_ids = input_ids.cpu().numpy()[:, 0]  # (B,)
        listed = token_ids.tolist()  # (a few ints: cheaper than two numpy reductions)
        vocab = len(self.weights.embed)
        if min(listed) < 0 or max(listed) >= vocab:
            raise IndexError(
                f"token ids must lie in [0, {vocab}), got min {min(listed)} and max {max(listed)}"
            )
        with torch_threads(1):  # the cache's torch calls: no OpenMP pool spinning beside OpenBLAS
            windows = self.config.layer_windows
            past = cache.get_seq_length()
            plan = cache.begin(1, attention_mask, device=torch.device("cpu"), windows=windows)
            try:
                return torch.from_numpy(self._run(token_ids, plan, cache))
            except BaseException:  # Ctrl-C between layers: undo the step (as the torch forward does)
                cache.abandon_forward(past)
                raise

    def _run(self, token_ids: np.ndarray, plan, cache) -> np.ndarray:
        batch = len(token_ids)
        heads, kv_heads, head_dim, group = self.heads, self.kv_heads, self.head_dim, self.group
        rotated = heads + kv_heads
        start = plan.start  # one int position for every row, or each row's own
        positions = start if isinstance(start, int) else plan.positions.numpy()[:, 0]
        turn = self.rotations(positions)  # (B or 1, D, D)
        visible_by_mask: dict[int, torch.Tensor | None] = {}
        x = self.weights.embed[token_ids]  # (B, hidden), a copy
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate is inf: silu -> -0
            for index, w in enumerate(self.weights.layers):
                qkv = _linear(_rms_norm(x, w.norm1, self.eps), w.qkv, w.qkv_bias)
                qkv = qkv.reshape(batch, rotated + kv_heads, head_dim)  # (B, H + 2·H_kv, D)
                if w.q_norm is not None:  # qwen3: each head's q and k normalised before RoPE
                    for lo, hi, weight in ((0, heads, w.q_norm), (heads, rotated, w.k_norm)):
                        rows = qkv[:, lo:hi].reshape(-1, head_dim)
                        qkv[:, lo:hi] = _rms_norm(rows, weight, self.eps).reshape(batch, hi - lo, head_dim)
                turned = qkv[:, :rotated] @ turn  # (B, H + H_kv, D): queries and keys
                q = turned[:, :heads]  # (B, H, D)
                q *= self.scale  # the 1/sqrt(D) of attention, on the queries (fewer than scores)
                k = turned[:, heads:].reshape(batch, kv_heads, 1, head_dim)
                v = qkv[:, rotated:].reshape(batch, kv_heads, 1, head_dim)
                keys, values = cache.update_arrays(k, v, index)  # (B, H_kv, T_kv, D)
                # each kv head with its group of queries: (B, H_kv, G, D) over (B, H_kv, T_kv, D);
                # torch's fused attention on views of the arrays (one call, no score copies)
                attended = F.scaled_dot_product_attention(
                    torch.from_numpy(q.reshape(batch, kv_heads, group, head_dim)),
                    torch.from_numpy(keys),
                    torch.from_numpy(values),
                    attn_mask=self._visible(plan.mask(index), visible_by_mask),
                    scale=1.0,  # the queries carry 1/sqrt(D) already
                ).numpy()  # (B, H_kv, G, D)
                x += _linear(attended.reshape(batch, heads * head_dim), w.o, w.o_bias)
                gate_up = _linear(_rms_norm(x, w.norm2, self.eps), w.gate_up, w.gate_up_bias)
                inner = gate_up.shape[-1] // 2
                gate, up = gate_up[:, :inner], gate_up[:, inner:]
                act = np.negative(gate)
                np.exp(act, out=act)
                act += 1.0
                np.divide(gate, act, out=act)  # silu(gate) = gate / (1 + exp(-gate))
                act *= up
                x += _linear(act, w.down, w.down_bias)
        return _linear(
            _rms_norm(x, self.weights.final_norm, self.eps), self.weights.lm_head, None
        )  # (B, vocab)

    @staticmethod
    def _visible(
        mask: torch.Tensor | None, seen: dict[int, torch.Tensor | None]
    ) -> torch.Tensor | None:
        """A layer's boolean mask (B or 1, 1, 1, T_kv), None when absent or all True (layers
        that share a mask object check it once)."""
        if mask is None:
            return None
        key = id(mask)
        if key not in seen:
            if mask.dtype != torch.bool:
                raise BackendError(
                    f"the numpy step reads boolean masks (True = may attend), got {mask.dtype}"
                )
            seen[key] = None if bool(mask.all()) else mask
        return seen[key]
