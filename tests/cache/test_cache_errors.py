"""Bad use fails loudly with a named error that says what was expected and what was given."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache import (
    Cache,
    CacheConfigError,
    CacheCropError,
    CacheDeviceError,
    CacheDtypeError,
    CacheError,
    CacheOverflowError,
    CacheShapeError,
    DynamicCache,
    LayerIndexError,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
    make_cache,
)


def kv(batch=1, heads=2, tokens=1, dim=4, dtype=torch.float32, device="cpu"):
    shape = (batch, heads, tokens, dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(
        shape, dtype=dtype, device=device
    )


KINDS = {
    "dynamic": lambda: DynamicCache(),
    "static": lambda: StaticCache(max_cache_len=16, num_layers=2),
    "sliding": lambda: make_cache("sliding", window=4, num_layers=2),
}


def test_every_error_is_a_value_error():
    for error in (CacheShapeError, CacheDtypeError, CacheDeviceError, LayerIndexError,
                  CacheCropError, CacheOverflowError, CacheConfigError):
        assert issubclass(error, CacheError) and issubclass(error, ValueError)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_wrong_rank_names_the_expected_layout(kind):
    cache = KINDS[kind]()
    with pytest.raises(CacheShapeError, match=r"4-D \(batch, kv_heads, new_tokens, head_dim\)"):
        cache.update(torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_k_and_v_must_agree(kind):
    cache = KINDS[kind]()
    k, _ = kv(tokens=2)
    _, v = kv(tokens=3)
    with pytest.raises(CacheShapeError, match="agree"):
        cache.update(k, v, 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"batch": 2}, CacheShapeError, "batch 2 .* batch 1"),
        ({"heads": 3}, CacheShapeError, "3 kv heads.* 2 kv heads"),
        ({"dim": 5}, CacheShapeError, "head dims 5, 5; the cache holds 4, 4"),
        ({"dtype": torch.float64}, CacheDtypeError, "torch.float64.*stores torch.float32"),
        ({"device": "meta"}, CacheDeviceError, "meta.*cache is on cpu"),
    ],
)
def test_mismatch_with_what_is_stored(kind, change, error, message):
    cache = KINDS[kind]()
    cache.update(*kv(), 0)
    with pytest.raises(error, match=message):
        cache.update(*kv(**change), 0)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_layer_index_out_of_range(kind):
    cache = KINDS[kind]()
    with pytest.raises(LayerIndexError):
        cache.update(*kv(), 7 if kind != "dynamic" else 1)
    with pytest.raises(LayerIndexError):
        cache.get_seq_length(-1)
    with pytest.raises(IndexError):  # also an IndexError, as for a list
        cache.update(*kv(), -1)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_negative_crop(kind):
    cache = KINDS[kind]()
    cache.update(*kv(tokens=3), 0)
    with pytest.raises(CacheCropError, match="got -1"):
        cache.crop(-1)
    assert cache.get_seq_length() == 3


def test_static_overflow_states_capacity_and_requested_length():
    cache = StaticCache(1, 8, num_layers=1)
    cache.update(*kv(tokens=6), 0)
    message = "capacity is 8 tokens, requested length is 9"
    with pytest.raises(CacheOverflowError, match=message) as e:
        cache.update(*kv(tokens=3), 0)
    assert (e.value.capacity, e.value.requested, e.value.layer_idx) == (8, 9, 0)
    assert cache.get_seq_length() == 6  # nothing silently written or truncated
    with pytest.raises(CacheOverflowError):
        cache.attention_masks(3)


def test_static_layer_built_for_sizes_refuses_others():
    layer = StaticLayer(8, batch_size=1, kv_heads=2, head_dim=4, dtype=torch.float32)
    assert layer.nbytes == 2 * 1 * 2 * 8 * 4 * 4
    with pytest.raises(CacheShapeError, match="batch 2"):
        layer.update(*kv(batch=2))
    lazy = StaticLayer(8, kv_heads=3)
    with pytest.raises(CacheShapeError, match="kv_heads=3, k has kv_heads=2"):
        lazy.update(*kv())


def test_sliding_crop_beyond_the_window_is_refused():
    layer = SlidingWindowLayer(4, max_rollback=2)
    cache = Cache([layer])
    cache.update(*kv(tokens=10), 0)
    cache.crop(8)  # within max_rollback
    with pytest.raises(CacheCropError, match="no longer holds positions below 4"):
        cache.crop(5)
    assert cache.get_seq_length() == 8


def test_attention_mask_must_cover_past_and_new_tokens():
    cache = DynamicCache()
    cache.update(*kv(tokens=3), 0)
    with pytest.raises(CacheShapeError, match=r"\(batch, 5\) with past=3.*got shape \(1, 4\)"):
        cache.attention_masks(2, torch.ones(1, 4))
    with pytest.raises(CacheShapeError, match="batch 2; the cache holds batch 1"):
        cache.attention_masks(2, torch.ones(2, 5))
    with pytest.raises(CacheShapeError, match="new_tokens"):
        cache.attention_masks(0)


def test_batch_operations_check_indices():
    cache = DynamicCache()
    cache.update(*kv(batch=2), 0)
    with pytest.raises(CacheShapeError, match=r"\[0, 2\)"):
        cache.select(torch.tensor([0, 2]))
    with pytest.raises(CacheShapeError, match="one entry per batch row"):
        cache.reorder(torch.tensor([1]))
    with pytest.raises(CacheShapeError, match="repeats"):
        cache.repeat_interleave(0)


def test_config_contradictions_are_refused():
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 4}
    with pytest.raises(CacheConfigError, match="num_layers=3 contradicts"):
        make_cache("dynamic", config=config, num_layers=3)
    with pytest.raises(CacheConfigError, match="max_cache_len"):
        make_cache("static", config=config)
    with pytest.raises(CacheConfigError, match="window"):
        make_cache("sliding", config=config)
    mixed = {**config, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    with pytest.raises(CacheConfigError, match=r"layers \[1\] as full attention"):
        make_cache("sliding", config=mixed)
    with pytest.raises(CacheConfigError, match="chunked_attention"):
        make_cache("dynamic", config={**mixed, "layer_types": ["chunked_attention"] * 2})


MIXED = {
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "sliding_window": 4,
    "layer_types": ["full_attention", "sliding_attention"],
}


def test_refused_crop_changes_no_layer():
    cache = make_cache("dynamic", config=MIXED)
    for layer in range(2):
        cache.update(*kv(tokens=7), layer)
    with pytest.raises(CacheCropError, match="sliding layer 1"):
        cache.crop(6)
    assert [cache.get_seq_length(i) for i in range(2)] == [7, 7]


def test_max_rollback_lets_a_mixed_cache_roll_back():
    cache = make_cache("dynamic", config=MIXED, max_rollback=3)
    for layer in range(2):
        cache.update(*kv(tokens=7), layer)
    cache.crop(4)
    assert [cache.get_seq_length(i) for i in range(2)] == [4, 4]
    assert cache.layers[1].keys.shape[2] == 4
