"""Boolean attention masks from absolute positions.

A layer describes the keys it will return by their absolute positions (-1 for an empty slot)
and the queries of a chunk by theirs; the mask is then one formula for every cache kind:
causal, optionally within a window, minus padding columns, and never a fully masked row.
"""

from __future__ import annotations

import torch

from .errors import CacheShapeError


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The one rule of which key a query sees, True = may attend: a key at or before the query's
    position (and not an empty slot, -1), within the last `window` positions when a window is
    given (a query at q sees keys in (q - window, q]). queries and keys are absolute positions of
    shapes that broadcast (e.g. (..., T_new, 1) against (..., 1, T_kv)); the result has theirs."""
    allowed = (keys <= queries) & (keys >= 0)
    if window:
        allowed &= keys > queries - window
    return allowed


def build_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    window: int | None = None,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean mask, True = may attend.

    Args:
        query_positions: (T_new,) long, absolute position of each query of the chunk.
        key_positions: (T_kv,) long, absolute position of each key row; -1 marks an empty slot.
        window: if given, a query at q sees keys in (q - window, q] (itself and window-1 before).
        attention_mask: (B, L) with 1 = real token, 0 = padding, indexed by absolute position;
            positions >= L count as padding.

    Returns:
        (B or 1, 1, T_new, T_kv) bool. The key at the query's own position is always allowed, so
        no row is fully masked (a padding query attends to itself) and SDPA never yields NaN.
    """
    q = query_positions[:, None]  # (T_new, 1)
    kpos = key_positions[None, :]  # (1, T_kv)
    allowed = visible_keys(q, kpos, window)  # (T_new, T_kv)
    own = kpos == q  # (T_new, T_kv)
    if attention_mask is None:
        return (allowed | own)[None, None]  # (1, 1, T_new, T_kv)
    if attention_mask.dim() != 2:
        raise CacheShapeError(
            f"attention_mask must be 2-D (batch, past + new_tokens), "
            f"got shape {tuple(attention_mask.shape)}"
        )
    length = attention_mask.shape[1]
    index = key_positions.clamp(0, length - 1)  # (T_kv,)
    real = attention_mask.to(torch.bool).index_select(1, index)  # (B, T_kv)
    real = real & (key_positions >= 0) & (key_positions < length)
    mask = allowed[None] & real[:, None, :]  # (B, T_new, T_kv)
    return (mask | own[None])[:, None]  # (B, 1, T_new, T_kv)


def narrower_window(first: int | None, second: int | None) -> int | None:
    """The window a layer attends within when two windows apply (the model's and the one a cache
    keeps): the narrower; None (full attention) only when neither gives one."""
    if first is None or second is None:
        return second if first is None else first
    return min(first, second)
