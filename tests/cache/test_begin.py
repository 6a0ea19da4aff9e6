"""`Cache.begin` is what a model asks once per forward: the new tokens' positions and each layer's
mask, or no masks when every key is visible. For every cache kind and history: skipping the masks
is only ever allowed where every mask would be all True, and the positions are the ones the
masks (and a naive count) put the queries at."""

from __future__ import annotations

import torch
from cache_kinds import DIM, HEADS, KINDS, LAYERS, build_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import ForwardPlan, make_cache


def build(kind: str):
    return build_cache(kind, max_cache_len=40, window=3, max_batch_size=1)


def fill(cache, chunks) -> None:
    for chunk in chunks:
        for layer in range(LAYERS):
            k = torch.randn(1, HEADS, chunk, DIM)
            cache.update(k, torch.randn_like(k), layer)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    chunks=st.lists(st.integers(1, 6), min_size=0, max_size=6),
    new_tokens=st.integers(1, 3),
)
def test_no_masks_only_when_every_mask_is_all_true(kind, chunks, new_tokens):
    past = sum(chunks)
    for attention_mask in (None, torch.ones(1, past + new_tokens, dtype=torch.long)):
        cache, twin = build(kind), build(kind)
        fill(cache, chunks)  # the same history (masks do not depend on the values)
        fill(twin, chunks)
        plan = cache.begin(new_tokens, attention_mask)
        assert isinstance(plan, ForwardPlan)
        assert plan.positions.tolist() == [list(range(past, past + new_tokens))]
        if plan.masks is None:
            masks = twin.attention_masks(new_tokens, attention_mask)
            assert all(bool(masks[layer].all()) for layer in range(LAYERS))
            assert new_tokens == 1  # a chunk is causal within itself


def test_a_dynamic_cache_skips_masks_on_decode_steps_only():
    cache = build("dynamic")
    assert build("dynamic_lazy").begin(1).masks is None  # a fresh layer holds only the new token
    assert build("dynamic_lazy").begin(2).masks is not None
    fill(cache, [5])
    assert cache.begin(1).masks is None
    assert cache.begin(1).mask(0) is None
    assert cache.begin(2).masks is not None  # a chunk is causal within itself
    static = build("static")  # update returns the filled rows only: all visible too
    fill(static, [5])
    assert static.begin(1).masks is None
    sliding = build("sliding")
    fill(sliding, [5])
    assert sliding.begin(1).masks is not None  # its window hides keys
    compiled = make_cache(
        "static",
        config=dict(num_hidden_layers=LAYERS, num_key_value_heads=HEADS, head_dim=DIM),
        max_cache_len=40,
        compiled=True,
    )
    fill(compiled, [5])
    assert compiled.begin(1).masks is not None  # the whole buffer comes back: unfilled rows masked


def test_positions_count_real_tokens_of_a_left_padded_mask():
    cache = build_cache("dynamic", max_cache_len=40, window=3)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plan = cache.begin(5, mask)
    assert plan.positions.tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    for layer in range(LAYERS):
        cache.update(torch.randn(2, HEADS, 5, DIM), torch.randn(2, HEADS, 5, DIM), layer)
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    assert cache.begin(1, grown).positions.tolist() == [[3], [5]]


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(KINDS), chunks=st.lists(st.integers(1, 6), max_size=3),
       new_tokens=st.integers(1, 6))
def test_causal_marks_exactly_the_masks_that_are_plain_causal(kind, chunks, new_tokens):
    """CAUSAL stands in for a mask only where the explicit mask is the (T, T) lower triangle."""
    from kvcache.cache.plan import CAUSAL

    cache, twin = build(kind), build(kind)
    fill(cache, chunks)
    fill(twin, chunks)
    plan = cache.begin(new_tokens)
    explicit = twin.attention_masks(new_tokens)
    for layer in range(LAYERS):
        mask = plan.mask(layer)
        if mask is CAUSAL:
            assert torch.equal(explicit[layer], CAUSAL.tensor(new_tokens))
            assert not chunks and new_tokens > 1  # a prompt into an empty cache
    if kind == "dynamic" and not chunks and new_tokens > 1:
        assert plan.mask(0) is CAUSAL  # where it applies, it is used


def test_a_prompt_through_causal_attention_gives_the_explicit_masks_logits():
    """The model with CAUSAL (no attention_mask) and with explicit masks (an all-ones
    attention_mask) on the same prompt: the same logits, for a plain and a windowed model."""
    from tiny_models import tiny_model

    from kvcache.cache.plan import CAUSAL

    windowed = [{"model_type": "mistral", "sliding_window": w} for w in (20, 4)]
    for overrides in ({}, *windowed):
        model = tiny_model(seed=3, **overrides)
        prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
        cache = make_cache("dynamic", config=model.config)
        marked = cache.begin(9, windows=model.config.layer_windows).mask(0)
        assert (marked is CAUSAL) == (overrides.get("sliding_window", 99) >= 9)  # a window of 4 masks more
        with torch.no_grad():
            fast = model(prompt).logits
            explicit = model(prompt, attention_mask=torch.ones(1, 9, dtype=torch.long)).logits
        torch.testing.assert_close(fast, explicit, atol=1e-5, rtol=1e-5)
