"""The Llama-family decoder (llama, mistral, qwen2, qwen3, phi3, olmo2, gemma, gemma2, gemma3_text).

Module names equal the Hugging Face checkpoint keys (`model.layers.3.self_attn.q_proj.weight`),
so loading is a strict name-for-name copy. The model talks to its cache only through the seam
(`begin` once per forward for positions and masks, then `update` per layer) and never asks what
kind of cache it has: the no-cache path is `NoCache`, an object that keeps nothing. It knows
nothing of decode backends (`kvcache.backends`), which are built from it.

Per token and layer, the forward does: RMSNorm -> q/k/v projections (qwen3: RMSNorm of each
head's q and k; olmo2: of all of q and of k, and its norms follow the sublayers) -> RoPE on q, k ->
cache.update(k, v) -> SDPA over the visible keys (GQA: kv heads shared by query groups) ->
o_proj -> residual; RMSNorm -> SwiGLU MLP -> residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.cache import Cache, make_cache
from kvcache.cache.plan import CAUSAL
from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION
from kvcache.model.config import NORM_PLACEMENTS, ModelConfig
from kvcache.model.rope import RotaryEmbedding, apply_rope


class CacheInTrainingError(RuntimeError):
    """A KV cache was asked for while the model trains with gradients on."""


@dataclass
class CausalLMOutput:
    """What a forward returns: logits (B, T_new, vocab) and the cache that now holds the keys."""

    logits: torch.Tensor
    past_key_values: object | None = None

    def __getitem__(self, name: str):
        return getattr(self, name)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in float32 whatever the activations' dtype. Gemma's
    variant (offset 1) scales by (1 + weight), in float32, before casting back."""

    def __init__(self, hidden_size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (self.offset + self.weight.float())).to(x.dtype)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, same values
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def softcapped_attention(q, keys, values, mask, scale: float, cap: float) -> torch.Tensor:
    """Attention whose scores are soft-capped, cap · tanh(q·kᵀ·scale / cap) (gemma2), which the
    fused kernel cannot do: q (B, H, T, D), keys/values (B, H_kv, T_kv, D), mask (B or 1, 1, T,
    T_kv) bool or None -> (B, H, T, D). Softmax in float32."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # (B, H, T, T_kv)
    scores = torch.tanh(scores / cap) * cap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, values)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE; keys and values go through the cache."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_width, kv_width = (
            config.hidden_size,
            self.num_heads * self.head_dim,
            (self.kv_heads * self.head_dim),
        )
        self.q_proj = nn.Linear(hidden, q_width, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_width, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_width, hidden, bias=config.o_bias)
        self.qk_norm = config.qk_norm  # None, "head" (qwen3) or "width" (olmo2)
        self.scale = config.attention_scale  # None: SDPA's 1/sqrt(D)
        self.softcap = config.attn_logit_softcap
        if config.qk_norm is not None:
            per_head = config.qk_norm == "head"
            offset = config.norm_weight_offset  # gemma3's q/k norms scale by 1 + w too
            self.q_norm = RMSNorm(self.head_dim if per_head else q_width, config.rms_norm_eps, offset)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_width, config.rms_norm_eps, offset)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        """x (B, T, hidden), cos/sin (B or 1, 1, T, D), mask (B or 1, 1, T, T_kv), `CAUSAL` or
        None (every key visible) -> (B, T, hidden)."""
        batch, new_tokens, _ = x.shape  # (B, T, hidden)
        q, k = self.q_proj(x), self.k_proj(x)  # (B, T, H·D), (B, T, H_kv·D)
        if self.qk_norm == "width":
            q, k = self.q_norm(q), self.k_norm(k)
        qkv = torch.cat([q, k, self.v_proj(x)], dim=-1)  # (B, T, (H+2·H_kv)·D)
        heads = qkv.view(batch, new_tokens, -1, self.head_dim).transpose(1, 2)
        # heads: (B, H + 2·H_kv, T, D); RoPE turns q and k in one op, v is left as it is
        qk = heads[:, : self.num_heads + self.kv_heads]
        if self.qk_norm == "head":
            normed = self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])
            qk = torch.cat(normed, dim=1)
        qk = apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # (B, H, T, D), (B, H_kv, T, D)
        v = heads[:, self.num_heads + self.kv_heads :]  # (B, H_kv, T, D)
        keys, values = cache.update(k, v, self.layer_idx)  # (B, H_kv, T_visible, D)
        causal = mask is CAUSAL  # a prompt into an empty cache: the fused kernel skips the masked half
        if self.softcap is None:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=None if causal else mask, is_causal=causal,
                enable_gqa=self.kv_heads != self.num_heads, scale=self.scale
            )  # (B, H, T, D)
        else:
            scale = self.scale if self.scale is not None else self.head_dim**-0.5
            mask = CAUSAL.tensor(new_tokens, q.device) if causal else mask
            out = softcapped_attention(q, keys, values, mask, scale, self.softcap)
        out = out.transpose(1, 2).reshape(batch, new_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or gemma's tanh-approximated GELU."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, hidden)."""
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention then MLP, each with a residual add; the RMSNorms sit where the family puts them
    (`norm_placement`): llama before each sublayer (input_layernorm, post_attention_layernorm),
    olmo2 after each (post_attention_layernorm, post_feedforward_layernorm), gemma2 on both
    sides (input, post_attention, pre_feedforward, post_feedforward)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.placement = config.norm_placement
        for name in NORM_PLACEMENTS[config.norm_placement]:
            norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
            setattr(self, f"{name}_layernorm", norm)
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        if self.placement == "pre":
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
            return x + self.mlp(self.post_attention_layernorm(x))
        attend = self.input_layernorm(x) if self.placement == "sandwich" else x
        x = x + self.post_attention_layernorm(self.self_attn(attend, cos, sin, mask, cache))
        feed = self.pre_feedforward_layernorm(x) if self.placement == "sandwich" else x
        return x + self.post_feedforward_layernorm(self.mlp(feed))


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # N(0, 1) as nn.Embedding's own initialisation, drawn here: its init.normal_ imports torch's
        # compiler (about a second of start-up) for a tensor a checkpoint overwrites
        initial = torch.randn(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=initial)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_weight_offset)
        self.rotary_emb = RotaryEmbedding(config)
        # gemma3: the sliding layers rotate at their own base
        self.local_rotary_emb = RotaryEmbedding(config, local=True) if config.local_rope_theta else None


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM, called like Hugging Face's:

    `model(input_ids, attention_mask=None, past_key_values=None, use_cache=None,
    position_ids=None)` -> CausalLMOutput(logits (B, T_new, vocab), past_key_values).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    #: what the loader says of the weights for a start-up line (a GGUF's kept blocks), or None
    weights_note: str | None = None

    @property
    def device(self) -> torch.device:
        """Where the model's tensors live (its final norm's device)."""
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of its float tensors and computations (its final norm's; the embedding's
        too, unless it is kept as quantized blocks)."""
        return self.model.norm.weight.dtype

    def _cache_for(self, input_ids: torch.Tensor, past_key_values, use_cache: bool | None):
        """(the cache a forward runs on, whether it is returned): `past_key_values`, else a new
        one that grows (use_cache, the default unless training) or keeps nothing. ValueError or
        TypeError for inputs a forward cannot take; a cache while training is refused."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, new_tokens), got shape {tuple(input_ids.shape)}")
        if input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must be integer token ids (int64 or int32), got {input_ids.dtype}")
        training = self.training and torch.is_grad_enabled()
        if training and (use_cache or past_key_values is not None):
            raise CacheInTrainingError(
                "a KV cache is for inference only: call model.eval() or run under "
                "torch.no_grad(), or pass use_cache=False and no past_key_values to train"
            )
        if use_cache is None:
            use_cache = not training
        cache = past_key_values
        if cache is not None and not isinstance(cache, Cache):
            raise TypeError(
                f"past_key_values must be a kvcache cache (kvcache.cache.Cache), got "
                f"{type(cache).__module__}.{type(cache).__name__}; a transformers cache converts "
                f"with kvcache.hf.from_transformers(cache)"
            )
        if cache is None:  # a new cache: one that grows, or one that keeps nothing
            kind = "dynamic" if use_cache else "none"
            cache = make_cache(kind, config=self.config, dtype=self.dtype, device=self.device)

        return cache, use_cache

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """Run T_new new tokens (B, T_new) on top of what `past_key_values` holds.

        attention_mask: (B, past + T_new), 1 = token, 0 = left padding. use_cache=None means
        "cache unless training": a new DynamicCache is made when none is given. With
        use_cache=False nothing is kept (NoCache). Positions, unless given, come from the cache
        (`begin`): counted from the mask (so left padding does not shift them), else from the
        cache length (each row's own, in a paged cache).
        logits_to_keep=n > 0 scores only the last n positions (0 = all).
        """
        cache, use_cache = self._cache_for(input_ids, past_key_values, use_cache)
        batch, new_tokens = input_ids.shape
        past = cache.get_seq_length()
        if attention_mask is not None:
            if attention_mask.shape != (batch, past + new_tokens):
                raise ValueError(
                    f"attention_mask must be (batch, past + new) = ({batch}, {past + new_tokens}), "
                    f"got {tuple(attention_mask.shape)}: append a 1 per generated token"
                )
        # positions, and masks within the model's windows whatever the cache keeps
        windows = self.config.layer_windows
        plan = cache.begin(new_tokens, attention_mask, device=input_ids.device, windows=windows)
        if position_ids is None:
            position_ids = plan.positions  # (B or 1, T_new)
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        if self.config.embedding_scale is not None:  # gemma: scaled in the activations' dtype
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)
        rope = self.model.rotary_emb(position_ids, x.dtype)  # cos, sin (B or 1, 1, T, D)
        local = self.model.local_rotary_emb
        local_rope = rope if local is None else local(position_ids, x.dtype)
        ropes = {FULL_ATTENTION: rope, SLIDING_ATTENTION: local_rope}
        try:
            for layer_idx, layer in enumerate(self.model.layers):
                cos, sin = ropes[self.config.layer_types[layer_idx]]
                x = layer(x, cos, sin, plan.mask(layer_idx), cache)
        except BaseException:  # Ctrl-C or a failing hook between layers: undo the forward
            cache.abandon_forward(past)
            raise
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # only the last positions are scored (prefill)
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab)
        cap = self.config.final_logit_softcap
        if cap is not None:  # gemma2
            logits = torch.tanh(logits / cap) * cap
        return CausalLMOutput(logits=logits, past_key_values=cache if use_cache else None)
