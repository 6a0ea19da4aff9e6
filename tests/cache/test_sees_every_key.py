"""`Cache.sees_every_key` may let a model skip building masks: whenever it says True, every mask
`attention_masks` would build must be all True, for every cache kind and history."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import make_cache

LAYERS, HEADS, DIM = 2, 2, 4
CONFIG = {
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": DIM,
    "hidden_size": HEADS * DIM,
}
KINDS = {
    "dynamic": {},
    "dynamic_lazy": {},  # no config: layers created by the first update
    "static": {"max_batch_size": 1, "max_cache_len": 40},
    "sliding": {"max_batch_size": 1, "max_cache_len": 40},
    "paged": {"max_batch_size": 1, "max_cache_len": 40},
    "quantized": {},
}


def build(kind: str):
    if kind == "dynamic_lazy":
        return make_cache("dynamic")
    config = dict(CONFIG, sliding_window=3) if kind == "sliding" else CONFIG
    return make_cache(kind, config=config, **KINDS[kind])


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(sorted(KINDS)),
    chunks=st.lists(st.integers(1, 6), min_size=0, max_size=6),
    new_tokens=st.integers(1, 3),
)
def test_true_only_when_every_mask_is_all_true(kind, chunks, new_tokens):
    cache = build(kind)
    for chunk in chunks:
        for layer in range(LAYERS):
            k = torch.randn(1, HEADS, chunk, DIM)
            cache.update(k, torch.randn_like(k), layer)
    if cache.sees_every_key(new_tokens, num_layers=LAYERS):
        masks = cache.attention_masks(new_tokens)
        assert all(bool(masks[layer].all()) for layer in range(LAYERS))
    padding = torch.ones(1, sum(chunks) + new_tokens, dtype=torch.long)
    assert not cache.sees_every_key(new_tokens, padding, num_layers=LAYERS)


def test_a_dynamic_cache_sees_every_key_on_decode_steps():
    cache = build("dynamic")
    assert not build("dynamic_lazy").sees_every_key(1, num_layers=LAYERS)  # no layer yet
    for layer in range(LAYERS):
        cache.update(torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 5, DIM), layer)
    assert cache.sees_every_key(1, num_layers=LAYERS)
    assert not cache.sees_every_key(2, num_layers=LAYERS)  # a chunk is causal within itself
    assert not cache.sees_every_key(1, num_layers=LAYERS + 1)  # a layer the cache lacks
    static = build("static")  # eager, update returns the filled rows only: all visible too
    for layer in range(LAYERS):
        static.update(torch.randn(1, HEADS, 5, DIM), torch.randn(1, HEADS, 5, DIM), layer)
    assert static.sees_every_key(1, num_layers=LAYERS)
    assert not build("sliding").sees_every_key(1, num_layers=LAYERS)  # its window hides keys
