"""`Cache.sees_every_key` may let a model skip building masks: whenever it says True, every mask
`attention_masks` would build must be all True, for every cache kind and history."""

from __future__ import annotations

import torch
from cache_kinds import DIM, HEADS, KINDS, LAYERS, build_cache
from hypothesis import given, settings
from hypothesis import strategies as st


def build(kind: str):
    return build_cache(kind, max_cache_len=40, window=3, max_batch_size=1)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
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
