"""Argument checks shared by the cache classes; each raises a named error that says what was
expected and what was given."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .errors import CacheCropError, CacheDtypeError, CacheShapeError

if TYPE_CHECKING:
    from .layer import CacheLayer


def where(layer_idx: int | None) -> str:
    """" (layer i)" for error messages, or "" when the index is unknown."""
    return "" if layer_idx is None else f" (layer {layer_idx})"


def check_kv_pair(k: torch.Tensor, v: torch.Tensor, layer_idx: int | None = None) -> None:
    """Raise `CacheShapeError` unless k, v are (B, H_kv, T_new, D) tensors that agree."""
    place = where(layer_idx)
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise CacheShapeError(
            f"k and v{place} must be tensors, got {type(k).__name__}, {type(v).__name__}"
        )
    if k.dim() != 4 or v.dim() != 4:
        raise CacheShapeError(
            f"k and v{place} must be 4-D (batch, kv_heads, new_tokens, head_dim), "
            f"got shapes {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[:3] != v.shape[:3]:
        raise CacheShapeError(
            f"k and v{place} must agree on (batch, kv_heads, new_tokens), "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.shape[2] < 1:
        raise CacheShapeError(f"k and v{place} carry no new tokens: shape {tuple(k.shape)}")
    if k.dtype != v.dtype or k.device != v.device:
        raise CacheDtypeError(
            f"k and v{place} must share dtype and device, got {k.dtype} on {k.device} "
            f"and {v.dtype} on {v.device}"
        )


def check_batch_index(
    indices: torch.Tensor | Sequence[int], batch: int, device: torch.device
) -> torch.Tensor:
    """Return `indices` as a 1-D long tensor on `device`; raise unless each is in [0, batch).
    An empty list keeps no row."""
    if not isinstance(indices, torch.Tensor) and len(indices) == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    index = torch.as_tensor(indices, device=device)
    if index.dim() != 1 or index.dtype not in (torch.int64, torch.int32):
        raise CacheShapeError(
            f"batch indices must be a 1-D integer tensor, got shape {tuple(index.shape)} "
            f"and dtype {index.dtype}"
        )
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= batch):
        raise CacheShapeError(
            f"batch indices must lie in [0, {batch}), got min {int(index.min())} "
            f"and max {int(index.max())}"
        )
    return index.to(torch.int64)


def check_crop(max_length: int) -> None:
    """Raise `CacheCropError` unless max_length is an int >= 0."""
    if isinstance(max_length, bool) or not isinstance(max_length, int):
        raise CacheCropError(f"crop length must be an int, got {type(max_length).__name__}")
    if max_length < 0:
        raise CacheCropError(
            f"crop length must be >= 0 (keep the first n tokens), got {max_length}"
        )


def check_new_tokens(new_tokens: int) -> None:
    """Raise `CacheShapeError` unless new_tokens is an int >= 1."""
    if isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1:
        raise CacheShapeError(f"new_tokens must be an int >= 1, got {new_tokens!r}")


def check_attention_mask(attention_mask: torch.Tensor, layer: CacheLayer, new_tokens: int) -> None:
    """Raise `CacheShapeError` unless attention_mask is (B, past + new_tokens) for `layer`."""
    past = layer.get_seq_length()
    shape = tuple(attention_mask.shape)
    if attention_mask.dim() != 2 or shape[1] != past + new_tokens:
        raise CacheShapeError(
            f"attention_mask must be (batch, past + new_tokens) = (batch, {past + new_tokens}) "
            f"with past={past}{where(layer.layer_idx)}, got shape {shape}"
        )
    batch = layer.batch_size
    if batch is not None and shape[0] != batch:
        raise CacheShapeError(
            f"attention_mask has batch {shape[0]}; the cache holds batch {batch}"
            f"{where(layer.layer_idx)}"
        )
