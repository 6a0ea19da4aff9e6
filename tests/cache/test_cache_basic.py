"""Basic behaviour of the cache seam: dynamic and no-cache paths, masks, factory."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache import (
    Cache,
    CacheConfigError,
    DynamicCache,
    DynamicLayer,
    LayerIndexError,
    NoCache,
    make_cache,
)

CONFIG = {"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 4}


def kv(batch: int = 1, heads: int = 2, tokens: int = 1, dim: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, heads, tokens, dim)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_dynamic_update_returns_whole_history_in_order():
    cache = DynamicCache()
    chunks = [kv(tokens=t, seed=t) for t in (5, 1, 1, 3)]
    for k, v in chunks:
        keys, values = cache.update(k, v, 0)
    assert torch.equal(keys, torch.cat([k for k, _ in chunks], dim=2))
    assert torch.equal(values, torch.cat([v for _, v in chunks], dim=2))
    assert cache.get_seq_length() == 10
    assert torch.equal(cache.layers[0].keys, keys)


def test_dynamic_cache_creates_layers_in_order_without_config():
    cache = DynamicCache()
    k, v = kv()
    cache.update(k, v, 0)
    cache.update(k, v, 1)
    assert len(cache.layers) == 2
    assert cache.get_seq_length(5) == 0
    with pytest.raises(LayerIndexError):
        cache.update(k, v, 3)


def test_dynamic_cache_from_config_rejects_layer_out_of_range():
    cache = make_cache("dynamic", config=CONFIG)
    assert len(cache.layers) == 3
    k, v = kv()
    with pytest.raises(LayerIndexError, match=r"\[0, 3\).*got 3"):
        cache.update(k, v, 3)
    with pytest.raises(IndexError):
        cache.update(k, v, -1)


def test_dynamic_layer_grows_geometrically_and_reports_bytes():
    layer = DynamicLayer(step=4, growth=2.0)
    k, v = kv(tokens=1)
    capacities = []
    for _ in range(20):
        layer.update(k, v)
        capacities.append(layer.capacity)
    assert sorted(set(capacities)) == [4, 8, 16, 32]
    per_row = 2 * 2 * 4 * 4  # K and V, 2 heads × 4 dims × 4 bytes
    assert layer.nbytes == 32 * per_row
    assert layer.nbytes_used == 20 * per_row


def test_masks_are_causal_and_match_returned_length():
    cache = make_cache("dynamic", config=CONFIG)
    k, v = kv(tokens=4)
    masks = cache.attention_masks(4)
    assert len(masks) == 3
    for i in range(3):
        keys, _ = cache.update(k, v, i)
        assert masks[i].shape == (1, 1, 4, keys.shape[2])
    assert torch.equal(masks[0][0, 0], torch.ones(4, 4, dtype=torch.bool).tril())
    step = cache.attention_masks(2)[0]
    assert step.shape == (1, 1, 2, 6)
    assert step[0, 0, 0].tolist() == [True] * 5 + [False]


def test_masks_drop_padding_columns_but_never_a_whole_row():
    cache = DynamicCache()
    attention_mask = torch.tensor([[0, 0, 1], [1, 1, 1]])
    mask = cache.attention_masks(3, attention_mask)[0]
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [
        [True, False, False],  # padding query sees itself only
        [False, True, False],
        [False, False, True],
    ]
    assert mask.any(dim=-1).all()


def test_masks_for_lazy_cache_cover_any_layer_index():
    cache = DynamicCache()
    masks = cache.attention_masks(2, torch.ones(1, 2))
    assert masks[0].shape == masks[7].shape == (1, 1, 2, 2)
    for layer in range(3):
        cache.update(*kv(tokens=2), layer)
    masks = cache.attention_masks(1, torch.ones(1, 3))  # past 2 + 1 new
    assert len(masks) == 3 and masks[2].shape == masks[9].shape == (1, 1, 1, 3)


def test_nocache_keeps_nothing_and_masks_causally():
    cache = make_cache("none")
    assert isinstance(cache, NoCache) and isinstance(cache, Cache)
    k, v = kv(tokens=3)
    out_k, out_v = cache.update(k, v, 5)
    assert out_k is k and out_v is v
    assert cache.get_seq_length() == 0 and cache.nbytes == 0
    mask = cache.attention_masks(3)[11]
    assert torch.equal(mask[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())
    padded = cache.attention_masks(2, torch.tensor([[0, 1]]))[0]
    assert padded[0, 0].tolist() == [[True, False], [False, True]]


def test_make_cache_rejects_unknown_kind():
    with pytest.raises(CacheConfigError, match="paged"):
        make_cache("paged")


MIXED = {
    "num_hidden_layers": 3,
    "num_key_value_heads": 2,
    "head_dim": 4,
    "sliding_window": 4,
    "layer_types": ("full_attention", "sliding_attention", "full_attention"),
}


@pytest.mark.parametrize(
    ("kind", "full_layer"), [("dynamic", "DynamicLayer"), ("static", "StaticLayer")]
)
def test_mixed_config_gets_a_layer_kind_per_layer(kind, full_layer):
    cache = make_cache(kind, config=MIXED, max_cache_len=16)
    names = [type(layer).__name__ for layer in cache.layers]
    assert names == [full_layer, "SlidingWindowLayer", full_layer]
    assert cache.layers[1].window == 4


def test_mistral_style_config_without_layer_types_is_all_sliding():
    config = {**MIXED, "layer_types": None}
    names = {type(layer).__name__ for layer in make_cache("dynamic", config=config).layers}
    assert names == {"SlidingWindowLayer"}
    off = {**config, "use_sliding_window": False}
    names = {type(layer).__name__ for layer in make_cache("dynamic", config=off).layers}
    assert names == {"DynamicLayer"}


def test_config_object_with_attributes_and_empty_layer_types():
    class Config:
        num_hidden_layers = 2
        num_key_value_heads = 2
        head_dim = 4
        sliding_window = None
        layer_types = ()

    cache = make_cache("static", config=Config(), max_cache_len=8, max_batch_size=1,
                       dtype=torch.float32)
    assert len(cache.layers) == 2 and cache.layers[0].keys.shape == (1, 2, 0, 4)


def test_nbytes_match_the_memory_planner():
    from kvcache.memory import kv_cache_bytes

    layers, heads, dim, batch = 3, 2, 4, 2
    static = make_cache("static", config=MIXED | {"layer_types": None, "sliding_window": None},
                        max_cache_len=16, max_batch_size=batch, dtype=torch.float32)
    assert static.nbytes == kv_cache_bytes(layers, heads, 16, dim, batch, "float32")
    dynamic = make_cache("dynamic", num_layers=layers)
    for layer in range(layers):
        dynamic.update(*kv(batch=batch, tokens=10), layer)
    assert dynamic.nbytes_used == kv_cache_bytes(layers, heads, 10, dim, batch, "float32")
    assert dynamic.nbytes >= dynamic.nbytes_used


def test_reset_forgets_tokens_and_keeps_storage():
    cache = make_cache("dynamic", num_layers=1)
    cache.update(*kv(tokens=5), 0)
    allocated = cache.nbytes
    cache.reset()
    assert cache.get_seq_length() == 0 and cache.nbytes == allocated
    keys, _ = cache.update(*kv(tokens=2, seed=4), 0)
    assert keys.shape[2] == 2


@pytest.mark.parametrize("kind", ["dynamic", "static", "sliding", "none"])
def test_positions_of_the_next_chunk(kind):
    cache = make_cache(kind, num_layers=2, max_cache_len=16, window=4)
    assert cache.positions(3).tolist() == [0, 1, 2]
    for layer in range(2):
        cache.update(*kv(tokens=6), layer)
    expected = [0, 1] if kind == "none" else [6, 7]
    assert cache.positions(2).tolist() == expected


def test_dynamic_default_growth_crosses_step_boundaries_without_losing_rows():
    layer = DynamicLayer()  # step 256, growth 1.5
    chunks = [kv(tokens=t, seed=i) for i, t in enumerate([255, 1, 1, 255, 1, 300])]
    capacities = []
    for k, v in chunks:
        keys, values = layer.update(k, v)
        capacities.append(layer.capacity)
    assert capacities == [256, 256, 512, 512, 768, 1280]  # 257 → 384 rounded up to 512
    assert torch.equal(keys, torch.cat([k for k, _ in chunks], dim=2))
    assert torch.equal(values, torch.cat([v for _, v in chunks], dim=2))
    assert keys.data_ptr() == layer._keys.data_ptr()  # a view of the buffer, not a copy
