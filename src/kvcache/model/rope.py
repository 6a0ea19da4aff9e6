"""Rotary position embedding (RoPE): inverse frequencies from the config, cos/sin per position,
and the rotation applied to queries and keys before they enter the cache.

Frequencies are computed in float32 the way the checkpoints were trained (Hugging Face's
convention: the two halves of head_dim are the two coordinates of each rotated pair).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvcache.model.config import ConfigError, ModelConfig


def inverse_frequencies(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """(head_dim / 2,) float32 rotation speeds, one per pair of dimensions, scaling applied.
    local=True: the sliding layers' own (gemma3's `local_rope_theta`, unscaled)."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    theta = config.local_rope_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta**exponents)  # (D/2,)
    scaling = None if local else config.rope_scaling
    if scaling is None or scaling.rope_type == "dynamic":
        # dynamic NTK equals the default up to max_position_embeddings (checked per forward)
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    raise ConfigError(f"rope scaling type {scaling.rope_type!r} is not supported")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp between."""
    old_context = scaling.original_max_position_embeddings
    low_wavelen = old_context / scaling.low_freq_factor  # longer than this: divide by factor
    high_wavelen = old_context / scaling.high_freq_factor  # shorter than this: unchanged
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * slowed / scaling.factor + smooth * slowed
    in_between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(in_between, blended, slowed)


class RotaryEmbedding(nn.Module):
    """Turns position ids (B, T) into cos and signed sin (B, 1, T, head_dim), activation dtype.
    local=True: the frequencies of the sliding layers in a model that gives them their own base
    (gemma3's `local_rope_theta`)."""

    def __init__(self, config: ModelConfig, local: bool = False) -> None:
        super().__init__()
        if local and config.local_rope_theta is None:
            raise ConfigError("a local RotaryEmbedding needs a config with local_rope_theta")
        self.register_buffer("inv_freq", inverse_frequencies(config, local), persistent=False)
        # dynamic NTK changes every frequency once positions pass this length, which would
        # make cached keys disagree with recomputed ones: refused rather than silently wrong
        self.limit = (
            config.max_position_embeddings
            if not local and config.rope_scaling is not None and config.rope_scaling.rope_type == "dynamic"
            else None
        )

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.limit is not None and int(position_ids.max()) >= self.limit:
            raise ConfigError(
                f"dynamic RoPE scaling beyond max_position_embeddings={self.limit} is not "
                f"supported (got position {int(position_ids.max())}); it would change the keys "
                "already in the cache"
            )
        angles = position_ids[..., None].float() * self.inv_freq  # (B, T, D/2)
        cos, sin = angles.cos(), angles.sin()
        # the first half of each head is rotated by -sin, the second by +sin (rotate_half)
        cos = torch.cat((cos, cos), dim=-1).to(dtype)  # (B, T, D)
        signed_sin = torch.cat((-sin, sin), dim=-1).to(dtype)  # (B, T, D)
        return cos.unsqueeze(1), signed_sin.unsqueeze(1)  # (B, 1, T, D)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, T, D) by the angles of RotaryEmbedding's cos, signed_sin (B, 1, T, D).

    Pairs are (i, i + D/2): x_i' = x_i·cos - x_{i+D/2}·sin, x_{i+D/2}' = x_{i+D/2}·cos + x_i·sin.
    """
    swapped = x.roll(x.shape[-1] // 2, dims=-1)  # (B, H, T, D): halves exchanged
    return x * cos + swapped * signed_sin
