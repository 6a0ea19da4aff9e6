"""Property tests: random streams of updates, crops and batch reorders for every layer kind,
checked against a naive history concatenated from scratch (K/V rows, lengths, positions,
masks)."""

from __future__ import annotations

import pytest
import torch
from cache_reference import NaiveHistory, check_step
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import (
    Cache,
    CacheCropError,
    CacheOverflowError,
    DynamicCache,
    DynamicLayer,
    SlidingWindowLayer,
    StaticLayer,
)

WINDOW = 4
STATIC_LEN = 24
BATCH, HEADS, DIM = 2, 2, 3
# chunk lengths that sit on every boundary: 1, W-1, W, W+1, 2W+1, growth steps of 4, 6, 9 rows
BOUNDARY_CHUNKS = [1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 1, 4, 6, 9]

LAYERS = {
    "dynamic": lambda: DynamicLayer(step=4, growth=1.5),
    "static": lambda: StaticLayer(STATIC_LEN),
    "sliding": lambda: SlidingWindowLayer(WINDOW),
    "sliding_rollback": lambda: SlidingWindowLayer(WINDOW, max_rollback=3),
}

update_op = st.tuples(
    st.just("update"), st.one_of(st.sampled_from(BOUNDARY_CHUNKS), st.integers(1, 12))
)
padded_update_op = st.tuples(st.just("padded_update"), st.sampled_from(BOUNDARY_CHUNKS))
crop_op = st.tuples(st.just("crop"), st.integers(0, 30))
reorder_op = st.tuples(st.just("reorder"), st.permutations(range(BATCH)))
operations = st.lists(
    st.one_of(update_op, update_op, padded_update_op, crop_op, reorder_op), min_size=1, max_size=14
)


def crop_allowed(layer, length: int, high_water: int, target: int) -> bool:
    """A ring has overwritten every position below high_water - capacity (high_water: the
    longest length ever reached); a crop may not make one of those visible again."""
    if not isinstance(layer, SlidingWindowLayer) or target >= length:
        return True
    return max(0, target - layer.window) >= max(0, high_water - layer.capacity)


def run_stream(kind: str, ops, seed: int) -> None:
    cache = Cache([LAYERS[kind]()])
    layer = cache.layers[0]
    window = layer.window
    history = NaiveHistory()
    high_water = 0
    generator = torch.Generator().manual_seed(seed)
    for op, arg in ops:
        if op in ("update", "padded_update"):
            shape = (BATCH, HEADS, arg, DIM)
            k = torch.randn(shape, generator=generator)
            v = torch.randn(shape, generator=generator)
            if kind == "static" and history.length + arg > STATIC_LEN:
                with pytest.raises(CacheOverflowError) as caught:
                    cache.update(k, v, 0)
                assert caught.value.capacity == STATIC_LEN
                assert caught.value.requested == history.length + arg
                continue
            padded = op == "padded_update"
            # any pattern of padding columns, new ones drawn for this chunk
            real = (torch.rand(BATCH, arg, generator=generator) > 0.3).long()
            positions = layer.mask_positions(arg, None)
            if padded:
                assert history.real is not None or history.length == 0
                so_far = history.real if history.real is not None else real[:, :0]
                mask = cache.attention_masks(arg, torch.cat([so_far, real], dim=1))[0]
            else:
                mask = cache.attention_masks(arg)[0]
            keys, values = cache.update(k, v, 0)
            history.append(k, v, real if padded else None)
            check_step(positions, mask, keys, values, history, window, padded)
        elif op == "crop":
            high_water = max(high_water, history.length)
            if crop_allowed(layer, history.length, high_water, arg):
                cache.crop(arg)
                history.crop(arg)
            else:
                with pytest.raises(CacheCropError):
                    cache.crop(arg)
        else:
            index = torch.tensor(arg)
            cache.reorder(index)
            history.select(index)
        assert cache.get_seq_length() == history.length
        shown = layer.keys
        if history.keys is None:
            continue
        held = history.length if window is None else min(history.length, window)
        assert shown is not None and shown.shape[2] == held
        assert torch.equal(shown, history.keys[:, :, history.length - held :])
        assert torch.equal(layer.values, history.values[:, :, history.length - held :])


@pytest.mark.parametrize("kind", sorted(LAYERS))
@settings(max_examples=40, deadline=None)
@given(ops=operations, seed=st.integers(0, 2**16))
def test_random_streams_match_naive_history(kind, ops, seed):
    run_stream(kind, ops, seed)


def test_two_crops_cannot_reach_positions_the_ring_overwrote():
    """Found by the property test: crop(6) then crop(1) after 9 tokens in a ring of 4 + 3 rows
    used to return the overwritten slot 0 (position 7) as position 0."""
    run_stream("sliding_rollback", [("update", 9), ("crop", 6), ("crop", 1)], seed=0)
    layer = SlidingWindowLayer(4, max_rollback=3)
    k = torch.arange(9.0).view(1, 1, 9, 1)
    layer.update(k, k)
    layer.crop(6)
    assert layer.keys.flatten().tolist() == [2.0, 3.0, 4.0, 5.0]
    with pytest.raises(CacheCropError, match="no longer holds positions below 2"):
        layer.crop(1)
    layer.reset()
    layer.update(k[:, :, :3], k[:, :, :3])
    layer.crop(1)  # nothing was overwritten since the reset
    assert layer.keys.flatten().tolist() == [0.0]


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("prefill", [1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 1])
def test_prefill_then_decode_crosses_every_boundary(kind, prefill):
    ops = [("update", prefill)] + [("update", 1)] * (STATIC_LEN - prefill)
    run_stream(kind, ops, seed=prefill)


def test_dynamic_cache_batch_operations_follow_the_reference():
    cache = DynamicCache()
    history = NaiveHistory()
    generator = torch.Generator().manual_seed(3)
    k = torch.randn(3, 2, 5, 4, generator=generator)  # (B, H_kv, T, D)
    v = torch.randn(3, 2, 5, 4, generator=generator)
    cache.update(k, v, 0)
    history.append(k, v)
    cache.select(torch.tensor([2, 0]))
    history.select(torch.tensor([2, 0]))
    cache.repeat_interleave(2)
    history.select(torch.tensor([0, 0, 1, 1]))
    assert torch.equal(cache.layers[0].keys, history.keys)
    assert torch.equal(cache.layers[0].values, history.values)


@pytest.mark.parametrize("kind", ["static", "sliding"])
def test_fixed_layers_select_and_repeat_change_the_batch(kind):
    layer = LAYERS[kind]()
    cache = Cache([layer])
    history = NaiveHistory()
    generator = torch.Generator().manual_seed(5)
    for tokens in (3, 1, 4):
        k = torch.randn(3, HEADS, tokens, DIM, generator=generator)
        v = torch.randn(3, HEADS, tokens, DIM, generator=generator)
        cache.update(k, v, 0)
        history.append(k, v)
    cache.select(torch.tensor([2, 0]))
    history.select(torch.tensor([2, 0]))
    cache.repeat_interleave(2)
    history.select(torch.tensor([0, 0, 1, 1]))
    k = torch.randn(4, HEADS, 1, DIM, generator=generator)
    v = torch.randn(4, HEADS, 1, DIM, generator=generator)
    positions = layer.mask_positions(1, None)
    mask = cache.attention_masks(1)[0]
    keys, values = cache.update(k, v, 0)
    history.append(k, v)
    check_step(positions, mask, keys, values, history, layer.window)
