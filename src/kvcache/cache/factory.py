"""make_cache: build a cache by name ("dynamic" | "static" | "sliding" | "quantized" | "none" | "paged")."""

from __future__ import annotations

from typing import Any

import torch

from kvcache.defaults import CACHE_KINDS

from .base import Cache
from .dynamic import DynamicCache
from .errors import CacheConfigError
from .nocache import NoCache
from .paged import PagedCache
from .quantized import QuantizedCache
from .sliding import SlidingWindowCache
from .static import StaticCache

KINDS = CACHE_KINDS


def make_cache(
    kind: str,
    *,
    config: Any = None,
    num_layers: int | None = None,
    max_batch_size: int | None = None,
    max_cache_len: int | None = None,
    window: int | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    max_rollback: int = 0,
    num_blocks: int | None = None,
    block_size: int = 16,
    compiled: bool = False,
    kv_dtype: str | None = None,
    kv_window: int = 0,
    **quantization: Any,
) -> Cache:
    """A cache of the given kind for a model described by `config` and/or explicit sizes.

    config: object or dict with num_hidden_layers, num_key_value_heads, head_dim,
    sliding_window (may be None), layer_types ("full_attention"/"sliding_attention" per layer,
    or None). In "dynamic" and "static" caches, sliding-attention layers get a ring of the
    window; "sliding" windows every layer (and refuses a config with full-attention layers).
    "none" keeps nothing (`NoCache`), its masks still windowed on sliding layers.
    max_rollback: extra ring rows per sliding layer so that `crop` can roll back that many
    tokens once the window has filled (speculative decoding); 0 keeps exactly the window.
    quantization: for "quantized" only, `QuantizedCache`'s bits, group_size, residual_length,
    key_axis, value_axis, scale_dtype.

    "paged" is a `PagedCache` of `num_blocks` blocks of `block_size` tokens (default: enough
    blocks for max_batch_size sequences of max_cache_len tokens), its rows stored as kv_dtype
    says ("bfloat16", "fp8", "int8", "int8/int4" …: `PagedCache`; paged only), each row's last
    kv_window tokens also kept in the forward's dtype (`PagedCache`'s full-precision window).
    compiled: for "static" and "sliding", layers made for torch.compile (whole buffers, the
    length in a tensor; `CompiledStaticLayer`).

    Raises `CacheConfigError` for an unknown kind or a missing/contradictory size.
    """
    _check_options(kind, quantization, kv_dtype is not None or bool(kv_window), compiled)
    if kind == "quantized":
        return QuantizedCache(
            num_layers, config=config, window=window, device=device, max_rollback=max_rollback,
            **quantization,
        )
    if kind == "dynamic":
        return DynamicCache(
            num_layers, config=config, window=window, device=device, max_rollback=max_rollback
        )
    if kind == "static":
        if max_cache_len is None:
            raise CacheConfigError("make_cache('static') needs max_cache_len")
        return StaticCache(max_batch_size, max_cache_len, config=config, num_layers=num_layers, window=window,
                           max_rollback=max_rollback, dtype=dtype, device=device, compiled=compiled)
    if kind == "sliding":
        return SlidingWindowCache(window, max_batch_size, config=config, num_layers=num_layers,
                                  max_rollback=max_rollback, dtype=dtype, device=device, compiled=compiled)
    if kind == "paged":
        if num_blocks is None:
            if max_cache_len is None:
                raise CacheConfigError("make_cache('paged') needs num_blocks or max_cache_len")
            num_blocks = (max_batch_size or 1) * -(-max_cache_len // block_size)
        return PagedCache(
            num_blocks, block_size, config=config, num_layers=num_layers, dtype=dtype, device=device,
            kv_dtype=kv_dtype, kv_window=kv_window,
        )
    if kind == "none":
        return NoCache(config=config, num_layers=num_layers, window=window, device=device)
    raise CacheConfigError(f"cache kind must be one of {KINDS}, got {kind!r}")


def _check_options(kind: str, quantization: dict, paged_rows: bool, compiled: bool) -> None:
    """Raise `CacheConfigError` for an option given to a kind it does not apply to (paged_rows:
    whether kv_dtype or kv_window was given)."""
    if quantization and kind != "quantized":
        raise CacheConfigError(f"{sorted(quantization)} apply to kind 'quantized' only, not {kind!r}")
    if paged_rows and kind != "paged":
        raise CacheConfigError(f"kv_dtype and kv_window apply to kind 'paged' only, not {kind!r}")
    if compiled and kind not in ("static", "sliding"):
        raise CacheConfigError(f"compiled=True applies to kinds 'static' and 'sliding', not {kind!r}")
