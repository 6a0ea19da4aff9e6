"""HalfBackend: the decode step of a bfloat16 or float16 CPU Llama-family model.

Why: a decode step reads every weight once, so on CPU it is bound by memory bandwidth, and
half-precision weights halve the bytes a token costs. torch's own half-precision products at one
row are slow to read their weights on the CPUs measured (bfloat16 `F.linear` re-lays its weight
out for oneDNN on every call), so the step keeps its own copy of the weights laid out once:
bfloat16 matrices in oneDNN's packed layout (`torch.ops.mkldnn`; its products read each weight
once whatever the number of rows and accumulate in float32), float16 ones as plain matrices for
`F.linear`. q/k/v and gate/up are fused into one matrix each, so a layer is four products.

The step computes the model's forward: RMSNorm, fused q/k/v, the per-head q/k norms (qwen3),
RoPE, the cache update, grouped-query attention under the plan's masks, o_proj, RMSNorm, SwiGLU,
residuals, the final norm and lm_head. What the torch forward does in the weights' dtype it does
in float32 (the residual stream, the norms, RoPE, SiLU); each product's input is rounded to the
weights' dtype and its output read back in float32; attention runs in the cache's dtype on the
stored keys and values, each kv head's group of queries as the rows. So its logits are as close
to a float32 forward of the same weights as the torch forward's in that dtype (the tests pin a
mean error within 1.25× and a worst within 2× of the torch forward's).

Like the numpy step it calls no module (`support.unsupported_structure`), and its copy of the
weights is the model's at build time: `matches` says whether every parameter is still the same
tensor, unchanged (its version counter), so a model written to since gets a new backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcache.backends.base import BackendError, DecodeBackend
from kvcache.backends.support import unsupported_parameters, unsupported_structure
from kvcache.model.rope import apply_rope

HALF_DTYPES = (torch.bfloat16, torch.float16)


def unsupported(model) -> str | None:
    """Why the half step cannot stand in for `model`'s decode forward, or None when it can."""
    reason = unsupported_structure(model, "the half step") or unsupported_parameters(
        model, HALF_DTYPES, "the half step"
    )
    if reason is None and model.dtype == torch.bfloat16 and not torch.backends.mkldnn.is_available():
        reason = "this torch build has no oneDNN (mkldnn), whose bfloat16 products the half step uses"
    return reason


def require_supported(model) -> None:
    """Raise `BackendError` saying why, unless the half step can stand in for `model`."""
    reason = unsupported(model)
    if reason is not None:
        raise BackendError(f"the half backend cannot run this model: {reason}; use the torch backend")


class _Product:
    """x (B, in) float32 -> x·Wᵀ + b (B, out) float32, W held in the weights' dtype and
    layout (see the module docstring); x is rounded to that dtype first."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().clone()
        if self.dtype == torch.bfloat16:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        else:
            self.weight = weight.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.dtype == torch.bfloat16:
            out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        else:
            out = F.linear(x, self.weight, self.bias)
        return out.float()


def _fused(*linears) -> _Product:
    weight = torch.cat([linear.weight for linear in linears])
    biases = [linear.bias for linear in linears]
    bias = None if biases[0] is None else torch.cat(biases)
    return _Product(weight, bias)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (..., n) float32 / rms(x) * weight (float32 (n,))."""
    return F.rms_norm(x, weight.shape, weight, eps)


class _Layer:
    """One decoder layer's weights as the step reads them."""

    def __init__(self, layer) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.norm1 = layer.input_layernorm.weight.detach().float()
        self.norm2 = layer.post_attention_layernorm.weight.detach().float()
        self.qkv = _fused(attention.q_proj, attention.k_proj, attention.v_proj)
        self.o = _Product(attention.o_proj.weight, attention.o_proj.bias)
        self.gate_up = _fused(mlp.gate_proj, mlp.up_proj)
        self.down = _Product(mlp.down_proj.weight, mlp.down_proj.bias)
        heads = attention.qk_norm == "head"
        self.q_norm = attention.q_norm.weight.detach().float() if heads else None
        self.k_norm = attention.k_norm.weight.detach().float() if heads else None


class HalfBackend(DecodeBackend):
    """Decode steps of a bfloat16 or float16 CPU LlamaForCausalLM on weights laid out once (see
    the module docstring). Raises `BackendError` for a model it cannot stand in for."""

    name = "half"

    def __init__(self, model) -> None:
        require_supported(model)
        config = model.config
        self.config = config
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        self.eps = float(model.model.norm.eps)
        self.dtype = model.dtype
        with torch.inference_mode(False), torch.no_grad():
            self.layers = [_Layer(layer) for layer in model.model.layers]
            self.embed = model.model.embed_tokens.weight.detach()  # the model's own: rows are read
            self.final_norm = model.model.norm.weight.detach().float()
            self.lm_head = _Product(model.lm_head.weight, None)
        self.rotary = model.model.rotary_emb
        self._sources = [(p, p.data_ptr(), p._version) for p in model.parameters()]
        self._buffers = [(b, b.data_ptr()) for b in model.buffers()]

    def matches(self, model) -> bool:
        """Whether this backend still computes `model`'s step: the same config, every parameter
        the one it copied, in place and unwritten since (its version counter), every buffer the
        one it read."""
        parameters, buffers = list(model.parameters()), list(model.buffers())
        return (
            model.config == self.config
            and len(parameters) == len(self._sources)
            and all(p is mine and p.data_ptr() == ptr and p._version == version
                    for p, (mine, ptr, version) in zip(parameters, self._sources))
            and len(buffers) == len(self._buffers)
            and all(b is mine and b.data_ptr() == ptr for b, (mine, ptr) in zip(buffers, self._buffers))
        )

    def decode(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, vocab) float32 logits of one decode step of input_ids (B, 1) on `cache` (see
        `DecodeBackend.decode`)."""
        self.check_step_ids(input_ids)
        vocab = self.embed.shape[0]
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise IndexError(f"token ids must lie in [0, {vocab}), got min {low} and max {high}")
        past = cache.get_seq_length()
        plan = cache.begin(1, attention_mask, device=input_ids.device, windows=self.config.layer_windows)
        try:
            with torch.no_grad():
                return self._run(input_ids[:, 0], plan, cache)
        except BaseException:  # Ctrl-C between layers: undo the step (as the torch forward does)
            cache.abandon_forward(past)
            raise

    def _run(self, token_ids: torch.Tensor, plan, cache) -> torch.Tensor:
        batch = token_ids.shape[0]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        cos, sin = self.rotary(plan.positions, torch.float32)  # (B or 1, 1, 1, D)
        x = self.embed[token_ids].float()  # (B, hidden)
        for index, w in enumerate(self.layers):
            qkv = w.qkv(_rms_norm(x, w.norm1, self.eps))  # (B, (H + 2·H_kv)·D)
            qkv = qkv.view(batch, heads + 2 * kv_heads, 1, head_dim)  # (B, H + 2·H_kv, 1, D)
            rotated = heads + kv_heads
            qk, v = qkv[:, :rotated], qkv[:, rotated:]  # queries and keys turn together
            if w.q_norm is not None:  # qwen3: each head's q and k normalised before RoPE
                qk = torch.cat([_rms_norm(qk[:, :heads], w.q_norm, self.eps),
                                _rms_norm(qk[:, heads:], w.k_norm, self.eps)], dim=1)
            qk = apply_rope(qk, cos, sin).to(self.dtype)  # keys stored as the model stores them
            q, k = qk[:, :heads], qk[:, heads:]
            keys, values = cache.update(k, v.to(self.dtype), index)  # (B, H_kv, T_kv, D)
            # each kv head with its group of queries as the "rows": (B, H_kv, G, D) over
            # (B, H_kv, T_kv, D), the mask (B or 1, 1, 1, T_kv) broadcast over the group (torch's
            # grouped-query flag is several times slower on half-precision keys)
            grouped = q.reshape(batch, kv_heads, heads // kv_heads, head_dim).to(keys.dtype)
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=plan.mask(index))
            x = x + w.o(attended.float().reshape(batch, heads * head_dim))
            gate_up = w.gate_up(_rms_norm(x, w.norm2, self.eps))  # (B, 2·inner)
            gate, up = gate_up.chunk(2, dim=-1)
            x = x + w.down(F.silu(gate) * up)
        return self.lm_head(_rms_norm(x, self.final_norm, self.eps))  # (B, vocab)
