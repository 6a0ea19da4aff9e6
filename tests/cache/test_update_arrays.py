"""`Cache.update_arrays` is `update` on numpy arrays: for every cache kind and any history of
updates, crops, resets and batch reorders (which replace a layer's buffers), it returns the
same keys and values as `update` on a twin cache, and leaves the cache in the same state (what
later updates return); in float32, and in bfloat16 passing as its bits (uint16: numpy has none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_kinds import CONFIG, DIM, HEADS, KINDS, LAYERS, build_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache.cache import CacheError, DynamicCache, DynamicLayer
from kvcache.cache.arrays import array_of, tensor_of


def build(kind: str, dtype: torch.dtype | None = None):
    # no batch size where the first update may fix it; paged needs one (then batch 1 is refused)
    batch = 2 if kind.startswith("paged") else None
    return build_cache(kind, max_cache_len=80, window=5, max_batch_size=batch, dtype=dtype)


# one action: ("update", tokens) | ("crop", length) | ("reset", 0) | ("reorder", 0)
ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("update"), st.integers(1, 7)),
        st.tuples(st.just("crop"), st.integers(0, 30)),
        st.tuples(st.just("reset"), st.just(0)),
        st.tuples(st.just("reorder"), st.just(0)),
    ),
    min_size=1,
    max_size=12,
)


def _arrays(batch: int, tokens: int, generator: torch.Generator, dtype: torch.dtype = torch.float32):
    """k, v (B, H, T, D) as numpy arrays, bfloat16 as its bits."""
    k, v = (torch.randn(batch, HEADS, tokens, DIM, generator=generator).to(dtype) for _ in range(2))
    return array_of(k), array_of(v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=30, deadline=None)
@given(actions=ACTIONS, batch=st.integers(1, 2), seed=st.integers(0, 99))
def test_update_arrays_equals_update(kind, dtype, actions, batch, seed):
    by_arrays, by_tensors = build(kind, dtype), build(kind, dtype)
    generator = torch.Generator().manual_seed(seed)
    for action, size in actions:
        if action == "update":
            k, v = _arrays(batch, size, generator, dtype)
            assert k.dtype == (np.uint16 if dtype == torch.bfloat16 else np.float32)
            for layer in range(LAYERS):
                try:
                    want = by_tensors.update(tensor_of(k.copy()), tensor_of(v.copy()), layer)
                except Exception as error:  # e.g. a full static cache: both must refuse
                    with pytest.raises(type(error)):
                        by_arrays.update_arrays(k.copy(), v.copy(), layer)
                    return
                got = by_arrays.update_arrays(k.copy(), v.copy(), layer)
                assert all(isinstance(array, np.ndarray) for array in got)
                assert want[0].dtype == dtype
                np.testing.assert_array_equal(got[0], array_of(want[0]))
                np.testing.assert_array_equal(got[1], array_of(want[1]))
        else:  # reorder: rows reversed, new buffers (index_select)
            change = {
                "crop": lambda cache, size=size: cache.crop(size),
                "reset": lambda cache: cache.reset(),
                "reorder": lambda cache: cache.reorder(list(range(batch))[::-1]),
            }[action]
            try:
                change(by_tensors)
            except Exception as error:  # e.g. a crop past what a sliding layer still holds
                with pytest.raises(type(error)):
                    change(by_arrays)
                return
            change(by_arrays)
        assert by_arrays.get_seq_length() == by_tensors.get_seq_length()


def test_a_dynamic_layer_writes_through_numpy_views_and_grows_through_update():
    layer = DynamicLayer(step=4, growth=1.5)
    k = np.ones((1, HEADS, 3, DIM), np.float32)
    keys, _ = layer.update_arrays(k, k)  # nothing stored yet: update allocates (capacity 4)
    assert keys.shape == (1, HEADS, 3, DIM) and layer.capacity == 4
    buffer = layer._keys
    keys, values = layer.update_arrays(2 * k[:, :, :1], 3 * k[:, :, :1])  # row 4 of 4: no torch call
    assert layer._keys is buffer and keys.shape == (1, HEADS, 4, DIM)
    assert float(keys[0, 0, 3, 0]) == 2 and float(values[0, 0, 3, 0]) == 3
    assert np.shares_memory(keys, layer.keys.numpy())
    keys, _ = layer.update_arrays(5 * k[:, :, :1], k[:, :, :1])  # full: update grows it
    assert layer._keys is not buffer and layer.capacity == 8
    assert keys.shape[2] == 5 and float(keys[0, 0, 4, 0]) == 5
    np.testing.assert_array_equal(layer.keys.numpy(), keys)


def test_a_bfloat16_layer_writes_its_bits_through_numpy_views():
    layer = DynamicLayer(step=4, growth=1.5)
    k = array_of(torch.full((1, HEADS, 3, DIM), 1.5, dtype=torch.bfloat16))  # uint16 bits
    keys, _ = layer.update_arrays(k, k)  # allocates a bfloat16 buffer
    assert layer._keys.dtype == torch.bfloat16 and keys.dtype == np.uint16
    buffer = layer._keys
    two = array_of(torch.full((1, HEADS, 1, DIM), 2.0, dtype=torch.bfloat16))
    keys, _ = layer.update_arrays(two, two)  # row 4 of 4: through the views, no torch call
    assert layer._keys is buffer and np.shares_memory(keys, array_of(layer._keys))
    assert tensor_of(keys)[0, 0, :, 0].tolist() == [1.5, 1.5, 1.5, 2.0]


def test_rows_that_do_not_fit_are_refused_as_update_refuses_them_and_nothing_is_stored():
    layer = DynamicLayer()
    k = np.zeros((1, HEADS, 2, DIM), np.float32)
    layer.update(torch.from_numpy(k), torch.from_numpy(k))
    for bad_k, bad_v in [
        (k.astype(np.float64), k.astype(np.float64)),  # another dtype
        (np.zeros((2, HEADS, 1, DIM), np.float32),) * 2,  # another batch
        (np.zeros((1, HEADS, 1, DIM + 1), np.float32),) * 2,  # another head dim
        (k[:, :, :1], k),  # k and v of different lengths
        (k[:, :, :0], k[:, :, :0]),  # no rows
    ]:
        with pytest.raises(CacheError) as by_arrays:
            layer.update_arrays(bad_k, bad_v)
        with pytest.raises(CacheError) as by_tensors:
            layer.update(torch.from_numpy(bad_k), torch.from_numpy(bad_v))
        assert type(by_arrays.value) is type(by_tensors.value)
        assert layer.get_seq_length() == 2


def _decode(cache, steps: int, generator: torch.Generator) -> list[np.ndarray]:
    out = []
    for _ in range(steps):
        k, v = _arrays(1, 1, generator)
        for layer in range(LAYERS):
            keys, values = cache.update_arrays(k.copy(), v.copy(), layer)
        out += [keys.copy(), values.copy()]
    return out


@pytest.mark.parametrize("copy_with", ["deepcopy", "pickle"])
def test_a_copied_cache_appends_into_its_own_buffers(copy_with):
    """A copy (deepcopy, pickle) takes its own views: appending to it never writes the original's
    buffers, and both go on exactly like twin caches fed through update."""
    import copy
    import pickle

    original = DynamicCache(config=CONFIG, step=64)
    _decode(original, 5, torch.Generator().manual_seed(0))  # the views are taken
    twin = copy.deepcopy(original) if copy_with == "deepcopy" else pickle.loads(pickle.dumps(original))
    before = [layer.keys.clone() for layer in original.layers]
    copied_out = _decode(twin, 4, torch.Generator().manual_seed(1))
    for layer, keys in zip(original.layers, before, strict=True):
        assert torch.equal(layer.keys, keys)  # the original is untouched
    assert twin.get_seq_length() == 9 and original.get_seq_length() == 5
    reference = DynamicCache(config=CONFIG, step=64)  # the same history through update
    generator = torch.Generator().manual_seed(0)
    for seed, steps in ((0, 5), (1, 4)):
        generator = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            k, v = _arrays(1, 1, generator)
            for layer in range(LAYERS):
                want = reference.update(torch.from_numpy(k.copy()), torch.from_numpy(v.copy()), layer)
    np.testing.assert_array_equal(copied_out[-2], want[0].numpy())
    for layer, ref in zip(twin.layers, reference.layers, strict=True):
        assert torch.equal(layer.keys, ref.keys) and torch.equal(layer.values, ref.values)


def test_replacing_the_buffers_drops_the_views_of_the_old_ones():
    """select / repeat_interleave / growth: the layer keeps no numpy view of a replaced buffer."""
    layer = DynamicLayer(step=4)
    k = np.ones((2, HEADS, 1, DIM), np.float32)
    layer.update(torch.from_numpy(k), torch.from_numpy(k))
    layer.update_arrays(k, k)  # views taken
    for replace in (
        lambda: layer.select(torch.tensor([1, 0])),
        lambda: layer.repeat_interleave(1),
        lambda: layer.update(torch.ones(2, HEADS, 2, DIM), torch.ones(2, HEADS, 2, DIM)),  # 4 -> 6: grows
    ):
        assert layer._arrays is not None
        replace()
        assert layer._arrays is None and layer._arrays_of == ()
        layer.update_arrays(k, k)  # taken again, of the new buffers
        assert np.shares_memory(layer._arrays[0], layer.keys.numpy())
