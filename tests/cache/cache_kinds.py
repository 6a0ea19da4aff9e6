"""Every cache kind, built small, for the property tests that run across kinds."""

from __future__ import annotations

import torch

from kvcache.cache import DynamicCache, make_cache

LAYERS, HEADS, DIM = 2, 2, 4
CONFIG = {
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": DIM,
    "hidden_size": HEADS * DIM,
}
# dynamic_growing: 4-row steps, so buffers grow (are replaced) within a test;
# dynamic_lazy: no config, layers created by the first update;
# *_compiled: the torch.compile layers (whole buffers, the length in a tensor), used eagerly
KINDS = ("dynamic", "dynamic_growing", "dynamic_lazy", "static", "static_compiled", "sliding",
         "sliding_compiled", "paged", "paged_sliding", "quantized")


def build_cache(kind: str, *, max_cache_len: int, window: int, max_batch_size: int | None = None,
                dtype: torch.dtype | None = None):
    """A cache of `kind` for CONFIG; fixed-size kinds hold max_cache_len tokens (a batch of
    max_batch_size, or whatever the first update brings where that is allowed), in `dtype`
    where given."""
    typed = {} if dtype is None else {"dtype": dtype}
    if kind == "dynamic_lazy":
        return make_cache("dynamic", **typed)
    if kind == "dynamic_growing":
        return DynamicCache(config=CONFIG, step=4, growth=1.5)  # (its dtype: the first update's)
    if kind in ("dynamic", "quantized"):
        return make_cache(kind, config=CONFIG, **typed)
    compiled = kind.endswith("_compiled")
    kind = kind.removesuffix("_compiled")
    if kind == "paged_sliding":  # every layer windowed: the window's blocks only, the rest given back
        config = dict(CONFIG, sliding_window=window)
        kind = "paged"
    else:
        config = dict(CONFIG, sliding_window=window) if kind == "sliding" else CONFIG
    sizes = {"max_cache_len": max_cache_len, **({"compiled": True} if compiled else {}), **typed}
    if max_batch_size is not None:
        sizes["max_batch_size"] = max_batch_size
    return make_cache(kind, config=config, **sizes)
