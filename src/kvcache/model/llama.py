"""The Llama-family decoder (llama, mistral, qwen2) in one file.

Module names equal the Hugging Face checkpoint keys (`model.layers.3.self_attn.q_proj.weight`),
so loading is a strict name-for-name copy. The model talks to its cache only through the seam
(`update`, `get_seq_length`, `attention_masks`) and never asks what kind of cache it has: the
no-cache path is `NoCache`, an object that keeps nothing.

Per token and layer, the forward does: RMSNorm -> q/k/v projections -> RoPE on q, k ->
cache.update(k, v) -> SDPA over the visible keys (GQA: kv heads shared by query groups) ->
o_proj -> residual; RMSNorm -> SwiGLU MLP -> residual.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kvcache.model.config import ModelConfig
from kvcache.model.kernels import MATVEC_ROWS, FusedLinear, calls_more_than_forward
from kvcache.model.rope import RotaryEmbedding, apply_rope


def no_cache(config: ModelConfig):
    """A cache object that keeps nothing past this forward (masks still windowed per layer)."""
    from kvcache.cache import make_cache

    return make_cache("none", config=config)


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
    """x / rms(x) * weight, the statistics in float32 whatever the activations' dtype."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # one op, same values
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


# rows (B·T) up to which a forward multiplies by the fused q/k/v and gate/up weights
FUSED_ROWS = 8


def _fused_applies(fused: FusedLinear | None, x: torch.Tensor) -> bool:
    """Whether x (B, T, in) goes through the fused weight: up to FUSED_ROWS rows (decode steps,
    short chunks), inference only, and only where that is the same as calling the linears
    (FusedLinear.replaces_calls). With more rows (a prefill) the separate projections run: on
    the CPU measured, MKL's product of 128 rows with the fused ~125M gate/up weight took 1.2-1.4×
    as long as the two halves', and a 128-token prefill of that model 280 against 248 ms; one
    decode row is faster fused (21.9 against 19.1 tok/s). Batches of 9+ rows were not measured."""
    return (
        fused is not None
        and x.numel() <= FUSED_ROWS * x.shape[-1]
        and not torch.is_grad_enabled()
        and fused.replaces_calls()
    )


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

    fused_qkv: FusedLinear | None = None  # set by kernels.fuse_projections

    def _qkv(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, hidden) -> (B, T, (H + 2·H_kv)·D): q, k, v side by side."""
        fused = self.fused_qkv
        if _fused_applies(fused, x):
            return F.linear(x, fused.weight, fused.bias)
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        batch, new_tokens, _ = x.shape  # (B, T, hidden)
        heads = self._qkv(x).view(batch, new_tokens, -1, self.head_dim).transpose(1, 2)
        # heads: (B, H + 2·H_kv, T, D); RoPE turns q and k in one op, v is left as it is
        qk = apply_rope(heads[:, : self.num_heads + self.kv_heads], cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]  # (B, H, T, D), (B, H_kv, T, D)
        v = heads[:, self.num_heads + self.kv_heads :]  # (B, H_kv, T, D)
        keys, values = cache.update(k, v, self.layer_idx)  # (B, H_kv, T_visible, D)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.kv_heads != self.num_heads
        )  # (B, H, T, D)
        out = out.transpose(1, 2).reshape(batch, new_tokens, self.num_heads * self.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    fused_gate_up: FusedLinear | None = None  # set by kernels.fuse_projections

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inner = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.up_proj = nn.Linear(hidden, inner, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inner, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused_gate_up
        if _fused_applies(fused, x):
            gate, up = F.linear(x, fused.weight, fused.bias).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, mask, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    """Embeddings, the decoder layers and the final norm (the checkpoint's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM, called like Hugging Face's:

    `model(input_ids, attention_mask=None, past_key_values=None, use_cache=None,
    position_ids=None)` -> CausalLMOutput(logits (B, T_new, vocab), past_key_values).
    """

    #: decode steps: "torch" (the module forward) or "numpy" (numpy_decode; float32 CPU, one new
    #: token per row, batch <= MATVEC_ROWS); see kernels.choose_decode_path
    matvec_backend: str = "torch"
    #: torch CPU threads for decode steps in kvcache.generate (None: the caller's setting)
    decode_threads: int | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

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
        use_cache=False nothing is kept (NoCache). Positions, unless given, are counted from
        the mask (so left padding does not shift them) or else from the cache length.
        logits_to_keep=n > 0 scores only the last n positions (0 = all).
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (batch, new_tokens), got shape {tuple(input_ids.shape)}")
        training = self.training and torch.is_grad_enabled()
        if training and (use_cache or past_key_values is not None):
            raise CacheInTrainingError(
                "a KV cache is for inference only: call model.eval() or run under "
                "torch.no_grad(), or pass use_cache=False and no past_key_values to train"
            )
        if use_cache is None:
            use_cache = not training
        cache = past_key_values
        if cache is None:
            from kvcache.cache import make_cache

            cache = (
                make_cache("dynamic", config=self.config, dtype=self.dtype, device=self.device)
                if use_cache
                else no_cache(self.config)
            )

        batch, new_tokens = input_ids.shape
        past = cache.get_seq_length()
        if attention_mask is not None:
            if attention_mask.shape != (batch, past + new_tokens):
                raise ValueError(
                    f"attention_mask must be (batch, past + new) = ({batch}, {past + new_tokens}), "
                    f"got {tuple(attention_mask.shape)}: append a 1 per generated token"
                )
        if self._numpy_step_applies(batch, new_tokens):
            # without a mask every row's new token sits at `past`: no position tensor is built
            positions = position_ids
            if positions is None:
                positions = past if attention_mask is None else self._positions(attention_mask, past, 1, None)
            logits = self._decode_on_numpy(input_ids, positions, attention_mask, cache)  # (B, 1, vocab)
            if logits is not None:  # None: the step declined (weights not float32 on CPU, …)
                return CausalLMOutput(logits=logits, past_key_values=cache if use_cache else None)
        if position_ids is None:
            position_ids = self._positions(attention_mask, past, new_tokens, input_ids.device)

        masks = cache.attention_masks(new_tokens, attention_mask)
        x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)  # (B or 1, 1, T, D)
        for layer_idx, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, masks[layer_idx], cache)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]  # only the last positions are scored (prefill)
        logits = self.lm_head(self.model.norm(x))  # (B, T, vocab)
        return CausalLMOutput(logits=logits, past_key_values=cache if use_cache else None)

    def _numpy_step_applies(self, batch: int, new_tokens: int) -> bool:
        """Whether this forward is a decode step the numpy kernel takes (see numpy_decode)."""
        return (
            self.matvec_backend == "numpy"
            and new_tokens == 1
            and batch <= MATVEC_ROWS
            and not torch.is_grad_enabled()
        )

    def decode_logits(self, input_ids: torch.Tensor, cache, *, check: bool = True) -> torch.Tensor | None:
        """(B, vocab) float32 logits of one decode step of input_ids (B, 1), every row unpadded
        at the cache's length, on the numpy step; None when that step does not apply (the caller
        then runs the model). The same step as `model(input_ids, past_key_values=cache)`, without
        its call overhead. check=False skips re-checking the step's weight views and hooks (see
        NumpyDecoder.ready): only for a caller that ran no other code since its last call."""
        batch, new_tokens = input_ids.shape
        if type(self).forward is not LlamaForCausalLM.forward or calls_more_than_forward(self):
            return None  # a subclass's forward, a hook or an instance forward: call the model
        if not self._numpy_step_applies(batch, new_tokens):
            return None
        logits = self._decode_on_numpy(input_ids, cache.get_seq_length(), None, cache, check=check)
        return None if logits is None else logits[:, 0]

    def _decode_on_numpy(
        self, input_ids, position_ids, attention_mask, cache, check: bool = True
    ) -> torch.Tensor | None:
        """Logits (B, 1, vocab) of a decode step on the numpy step, or None if it declines.
        Masks are built only when the cache cannot say that every key is visible."""
        decoder = self._numpy_decoder()
        if not decoder.ready(check):
            return None
        sees_all = getattr(cache, "sees_every_key", None)
        every_key = sees_all is not None and sees_all(
            1, attention_mask, num_layers=self.config.num_hidden_layers
        )
        masks = None if every_key else cache.attention_masks(1, attention_mask)
        return decoder.run(input_ids, position_ids, masks, cache)

    def forget_numpy_step(self) -> None:
        """Drop the numpy step's views (it is built again, from the current weights, when needed)."""
        self.__dict__.pop("_numpy_step", None)

    def _numpy_decoder(self):
        decoder = self.__dict__.get("_numpy_step")
        if decoder is None:
            from kvcache.model.numpy_decode import NumpyDecoder

            decoder = self.__dict__["_numpy_step"] = NumpyDecoder(self)
        return decoder

    @staticmethod
    def _positions(attention_mask, past: int, new_tokens: int, device) -> torch.Tensor:
        """(B or 1, T_new) position of each new token: real tokens before it (padding skipped)."""
        if attention_mask is None:
            return torch.arange(past, past + new_tokens, device=device).unsqueeze(0)
        counted = attention_mask.long().cumsum(-1) - 1  # (B, past + T)
        return counted[:, past:].clamp(min=0)
