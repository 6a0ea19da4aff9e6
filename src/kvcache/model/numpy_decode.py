"""One decode step of a float32 CPU Llama-family model, computed in numpy.

Why: a decode step is one new token per row. Its weights are read once each, so on CPU the
step is memory bandwidth (the ~100M model) or per-operation overhead (small models). numpy's
OpenBLAS matrix-vector product reads weights faster than torch's MKL one on the machines
measured (PERF-NOTES), and a numpy operation on a few hundred floats costs ~1-2 µs against
torch's ~5-10 µs. So this step runs the layers as a few dozen numpy calls on numpy *views* of
the model's own parameters (no copy), and talks to the cache through the same seam as the torch
path in its numpy form, `K, V = cache.update_arrays(k, v, layer_idx)`: a dynamic layer with room
writes the row through numpy views of its buffers (a torch `update` in a step whose weights just
streamed through the caches cost ~60 µs a layer); any other case is `cache.update` itself.

What it computes is the torch forward's: RMSNorm, fused q/k/v, RoPE (pairs i, i + D/2),
cache update, grouped-query attention with the cache's boolean masks, o_proj, RMSNorm, SwiGLU,
residuals, final norm, lm_head. Only steps of one new token per row (T_new == 1) on float32 CPU
weights are taken; everything else stays on the torch path.

The views are taken once and checked before a step (every step of `forward`; in `generate`,
the first step and every step after a streamer ran): a module or parameter that was replaced,
moved, cast or written in place makes the step take them again, so it never reads stale values.
The step calls no submodule, so it declines whenever calling the modules would do more than the
forwards it re-implements: a module of another class (a subclass, a wrapper), a forward hook or
pre-hook on a module or a global one, or a `forward` replaced on an instance. The torch path,
which calls them, runs instead.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import torch

from kvcache.cache.base import update_through_tensors
from kvcache.model.kernels import calls_more_than_forward, global_forward_hooks


def _view(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.detach().numpy()


class _LayerWeights:
    """numpy views of one decoder layer's weights (fused q/k/v and gate/up included); matrices
    as (in, out) transposed views, so a projection of rows x (B, in) is `x @ w`, one call."""

    __slots__ = ("norm1", "qkv", "qkv_bias", "o", "o_bias", "norm2", "gate_up", "gate_up_bias", "down",
                 "down_bias")

    def __init__(self, layer) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.norm1 = _view(layer.input_layernorm.weight)
        self.qkv, self.qkv_bias = _fused(attn.fused_qkv, [attn.q_proj, attn.k_proj, attn.v_proj])
        self.o, self.o_bias = _view(attn.o_proj.weight).T, _view(attn.o_proj.bias)
        self.norm2 = _view(layer.post_attention_layernorm.weight)
        self.gate_up, self.gate_up_bias = _fused(mlp.fused_gate_up, [mlp.gate_proj, mlp.up_proj])
        self.down, self.down_bias = _view(mlp.down_proj.weight).T, _view(mlp.down_proj.bias)


def _fused(fused, linears) -> tuple[np.ndarray, np.ndarray | None]:
    """The fused weight as (in, sum out) (and bias) when it still backs the parameters, else a
    concatenated copy."""
    if fused is not None and fused.is_intact():
        return _view(fused.weight).T, _view(fused.bias)
    weight = np.concatenate([_view(linear.weight) for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = np.concatenate([_view(b) for b in biases]) if all(b is not None for b in biases) else None
    return weight.T, bias


_VERSION = operator.attrgetter("_version")


class _Snapshot:
    """What the numpy views were taken from: every submodule, parameter and buffer of the model
    by identity (every registered name, None included), each module's class and number of
    entries, and each tensor's data pointer and version counter. `changed()` is True once any
    of them was replaced (a new module or Parameter, a bias where there was none, a child
    added), moved or cast (a new pointer) or written in place (`load_state_dict`, an optimizer
    step: a new version), so the views are never stale.

    It runs as `map`s over flat lists: before every decode step of `forward`, and in `generate`
    at the first decode step and after a streamer ran. On the ~3M model (94 entries, 40
    tensors) that was ~22 µs with warm caches but ~80-120 µs inside generation, right after the
    weights streamed through the CPU caches (timing `ready()` in `generate`). Inference tensors
    keep no version counter; like the torch path, a write into one in place is not seen."""

    def __init__(self, model) -> None:
        self.modules = list(model.modules())
        self.registries: list[dict] = []  # every module's _modules, _parameters and _buffers
        tables: list[dict] = []  # where each object is registered, under which name
        names: list[str] = []
        objects: list[object] = []
        tensors: list[torch.Tensor] = []
        for module in self.modules:
            for table in (module._modules, module._parameters, module._buffers):
                self.registries.append(table)
                for name, item in table.items():
                    tables.append(table), names.append(name), objects.append(item)
                    if isinstance(item, torch.Tensor):
                        tensors.append(item)
        self.tables, self.names, self.objects, self.tensors = tables, names, objects, tensors
        self.sizes = list(map(len, self.registries))
        self.types = list(map(type, self.modules))
        self.pointers = [tensor.data_ptr() for tensor in tensors]
        self.versioned = [tensor for tensor in tensors if not tensor.is_inference()]
        self.versions = list(map(_VERSION, self.versioned))
        self.submodules = self.modules[1:]  # the root's hooks ran already when forward runs

    def changed(self) -> bool:
        return (
            not all(map(operator.is_, map(dict.get, self.tables, self.names), self.objects))
            or list(map(len, self.registries)) != self.sizes
            or list(map(type, self.modules)) != self.types
            or list(map(torch.Tensor.data_ptr, self.tensors)) != self.pointers
            or list(map(_VERSION, self.versioned)) != self.versions
        )

    def intercepted(self) -> bool:
        """Whether calling the submodules (not the root, whose call is under way or is the
        caller's) does more than their `forward`: a forward hook or pre-hook on one of them or
        a global one, or an instance-level `forward` (a monkeypatch)."""
        return any(map(calls_more_than_forward, self.submodules)) or global_forward_hooks()


@functools.cache
def _standard_modules() -> frozenset[type]:
    """The module classes below a LlamaForCausalLM whose forwards the step computes."""
    from torch import nn

    from kvcache.model import llama, rope

    return frozenset(
        (llama.DecoderModel, llama.DecoderLayer, llama.Attention, llama.MLP, llama.RMSNorm,
         rope.RotaryEmbedding, nn.ModuleList, nn.Linear, nn.Embedding)
    )


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


def _linear(x: np.ndarray, weight_t: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    """x (rows, in) @ weight_t (in, out) (+ bias) -> (rows, out); for one row numpy runs
    OpenBLAS's matrix-vector product, the same kernel as `weight @ x[0]` (measured)."""
    out = x @ weight_t
    if bias is not None:
        out += bias
    return out


class NumpyDecoder:
    """Decode steps (one new token per row) of a LlamaForCausalLM whose weights are float32 on CPU."""

    def __init__(self, model) -> None:
        self.model = model
        config = model.config
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.group = self.heads // self.kv_heads
        self.eps = float(config.rms_norm_eps)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self._snapshot: _Snapshot | None = None
        self._ready: bool | None = None  # the last check's answer
        diagonal = np.arange(self.head_dim)
        partner = (diagonal + self.head_dim // 2) % self.head_dim
        # where cos and signed sin go in a flattened (D, D) rotation: (i, i) and (partner(i), i)
        self._cos_at = diagonal * self.head_dim + diagonal
        self._sin_at = partner * self.head_dim + diagonal
        self._build()

    def _build(self) -> None:
        self._snapshot = _Snapshot(self.model)
        #: every parameter float32 on CPU and every submodule of a class whose forward this step
        #: re-implements (else the step declines and the torch path runs)
        self.usable = all(
            parameter.dtype == torch.float32 and parameter.device.type == "cpu"
            for parameter in self.model.parameters()
        ) and all(type(module) in _standard_modules() for module in self._snapshot.submodules)
        if not self.usable:
            return
        decoder = self.model.model
        self.layers = [_LayerWeights(layer) for layer in decoder.layers]
        self.embed = _view(decoder.embed_tokens.weight)
        self.final_norm = _view(decoder.norm.weight)
        self.lm_head = _view(self.model.lm_head.weight).T  # (hidden, vocab)
        empty = np.zeros((0, self.head_dim), np.float32)
        self._cos, self._signed_sin = empty, empty  # the RoPE table, grown on demand

    def refresh(self) -> None:
        """Take the views again if the model changed since they were taken (see _Snapshot)."""
        if self._snapshot is None or self._snapshot.changed():
            self._build()

    def ready(self, check: bool = True) -> bool:
        """Whether the step can run: every parameter float32 on CPU and no module intercepted
        (see _Snapshot.intercepted), after refreshing the views. check=False answers as the
        last check did, without looking: only for a caller that ran no other code since."""
        if check or self._ready is None:
            self.refresh()
            assert self._snapshot is not None
            self._ready = self.usable and not self._snapshot.intercepted()
        return self._ready

    def rotations(self, position_ids: torch.Tensor | int) -> np.ndarray:
        """RoPE as matrices (B or 1, D, D) for position_ids (B or 1, 1), or one int position for
        every row: row vector x @ R is x turned to its position.

        x_i' = x_i·cos_i + x_{(i + D/2) mod D}·signed_sin_i, the torch path's `apply_rope`.
        One small product per layer (queries and keys together) replaces a roll, two products
        and a sum.
        """
        if not isinstance(position_ids, int) and position_ids.shape[0] == 1:
            position_ids = int(position_ids[0, 0])  # one position for every row
        if isinstance(position_ids, int):  # the usual case: scalar indexing, no temporary array
            index, needed, rows = position_ids, position_ids + 1, 1
        else:
            index = position_ids.numpy()[:, 0]  # (B,)
            needed, rows = int(index.max()) + 1, len(index)
        if needed > len(self._cos):
            self._extend_rope_table(needed)
        rotation = np.zeros((rows, self.head_dim * self.head_dim), np.float32)  # filled as (D, D)
        rotation[:, self._cos_at] = self._cos[index]
        rotation[:, self._sin_at] = self._signed_sin[index]
        return rotation.reshape(rows, self.head_dim, self.head_dim)

    def _extend_rope_table(self, needed: int) -> None:
        """cos and signed sin (N, D) of positions 0..N-1 for N >= needed (doubling), from the
        model's own RotaryEmbedding, so they are the torch path's values. Its range check (dynamic
        scaling stops at max_position_embeddings) applies: the table never grows past that limit,
        and a position beyond it raises as on the torch path."""
        rotary = self.model.model.rotary_emb
        size = max(needed, 2 * len(self._cos), 256)
        if rotary.limit is not None:
            size = max(needed, min(size, rotary.limit))
        cos, signed_sin = rotary(torch.arange(size)[None], torch.float32)  # (1, 1, N, D)
        self._cos, self._signed_sin = cos[0, 0].numpy(), signed_sin[0, 0].numpy()

    def step(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | int, masks, cache
    ) -> torch.Tensor | None:
        """Logits (B, 1, vocab) float32 for input_ids (B, 1) at position_ids (B or 1, 1), or at
        one int position for every row; None (nothing done) when the step does not apply (see
        `ready`: weights not all float32 on CPU, or a submodule hooked, patched or of another
        class).

        masks: None when every key the cache returns is visible to the new token, else one
        boolean mask per layer (B or 1, 1, 1, T_kv), True = may attend, as
        `cache.attention_masks(1, attention_mask)` gives them. The cache gets each layer's k, v.
        """
        if not self.ready():
            return None
        return self.run(input_ids, position_ids, masks, cache)

    def run(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | int, masks, cache
    ) -> torch.Tensor | None:
        """`step` for a caller that has just seen `ready()` return True (the views are not
        checked again: nothing may change the model in between)."""
        if input_ids.device.type != "cpu":
            return None
        if masks is not None and any(masks[i].dtype != torch.bool for i in range(len(self.layers))):
            return None  # an additive (float) mask from some other cache: the torch path reads it
        token_ids = input_ids.numpy()[:, 0]  # (B,)
        listed = token_ids.tolist()  # (a few ints: cheaper than two numpy reductions)
        if min(listed) < 0 or max(listed) >= len(self.embed):
            raise IndexError(
                f"token ids must lie in [0, {len(self.embed)}), got min {min(listed)} and max {max(listed)}"
            )
        batch = input_ids.shape[0]
        heads, kv_heads, head_dim, group = self.heads, self.kv_heads, self.head_dim, self.group
        rotated = heads + kv_heads
        turn = self.rotations(position_ids)  # (B or 1, D, D)
        visible_by_mask: dict[int, np.ndarray | None] = {}
        update = getattr(cache, "update_arrays", None) or functools.partial(update_through_tensors, cache)
        x = self.embed[token_ids]  # (B, hidden), a copy
        with np.errstate(over="ignore"):  # exp(-g) of a very negative gate is inf: silu -> -0
            for index, w in enumerate(self.layers):
                qkv = _linear(_rms_norm(x, w.norm1, self.eps), w.qkv, w.qkv_bias)
                qkv = qkv.reshape(batch, rotated + kv_heads, head_dim)  # (B, H + 2·H_kv, D)
                turned = qkv[:, :rotated] @ turn  # (B, H + H_kv, D): queries and keys
                q = turned[:, :heads]  # (B, H, D)
                q *= self.scale  # the 1/sqrt(D) of attention, on the queries (fewer than scores)
                k = turned[:, heads:].reshape(batch, kv_heads, 1, head_dim)
                v = qkv[:, rotated:].reshape(batch, kv_heads, 1, head_dim)
                keys, values = update(k, v, index)  # (B, H_kv, T_kv, D)
                # (B, H_kv, G, D) @ (B, H_kv, D, T_kv): each kv head with its group of queries
                scores = q.reshape(batch, kv_heads, group, head_dim) @ keys.swapaxes(-1, -2)
                if masks is not None:
                    visible = self._visible(masks[index], visible_by_mask)
                    if visible is not None:
                        scores = np.where(visible, scores, np.float32(-np.inf))
                # softmax; the ufuncs' reduce directly (ndarray.max/.sum add a Python wrapper)
                scores -= np.maximum.reduce(scores, axis=-1, keepdims=True)
                np.exp(scores, out=scores)
                attended = scores @ values  # (B, H_kv, G, D), weights not yet normalised
                attended /= np.add.reduce(scores, axis=-1, keepdims=True)
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
        logits = _linear(_rms_norm(x, self.final_norm, self.eps), self.lm_head, None)  # (B, vocab)
        return torch.from_numpy(logits)[:, None]

    @staticmethod
    def _visible(mask: torch.Tensor, seen: dict[int, np.ndarray | None]) -> np.ndarray | None:
        """The mask (B or 1, 1, 1, T_kv) as (B or 1, 1, 1, T_kv) numpy, None when all True."""
        key = id(mask)
        if key not in seen:
            visible = mask.numpy()
            seen[key] = None if visible.all() else visible
        return seen[key]
