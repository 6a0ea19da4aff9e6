"""What a cache filled elsewhere needs: a sliding layer loaded with only the last rows of a long
sequence continues as one that saw all of it, and a paged layer says where its keys sit."""

from __future__ import annotations

import pytest
import torch

from kvcache.cache import CacheCropError, CacheShapeError, PagedCache, SlidingWindowLayer


def rows(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 3, tokens, 4)  # (B, H_kv, T, D)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


@pytest.mark.parametrize("window, seen, given", [(4, 13, 3), (4, 13, 4), (5, 3, 3), (4, 30, 9), (6, 1, 1)])
@pytest.mark.parametrize("next_tokens", [1, 3, 7])
def test_a_sliding_layer_loaded_with_the_last_rows_continues_as_one_that_saw_everything(
    window, seen, given, next_tokens
):
    keys, values = rows(seen, seed=seen)
    full = SlidingWindowLayer(window)
    full.update(keys, values)
    loaded = SlidingWindowLayer(window)
    loaded.load_recent(keys[:, :, -given:], values[:, :, -given:], seen)
    assert loaded.get_seq_length() == seen
    k, v = rows(next_tokens, seed=99)

    def visible_keys(layer) -> dict[int, torch.Tensor]:
        """The keys the next update returns that its first query may see, by position."""
        query, key_positions = layer.mask_positions(next_tokens, None)
        returned_keys, _ = layer.update(k, v)
        return {
            position: returned_keys[:, :, index]
            for index, position in enumerate(key_positions.tolist())
            if position >= 0 and position > int(query[0]) - window
        }

    expected, got = visible_keys(full), visible_keys(loaded)
    assert expected.keys() == got.keys()
    for position, key in expected.items():
        assert torch.equal(got[position], key)
    torch.testing.assert_close(loaded.keys, full.keys)


def test_load_recent_refuses_fewer_rows_than_the_next_query_needs():
    keys, values = rows(2, seed=0)
    with pytest.raises(CacheShapeError, match=r"min\(seq_length, window - 1\) = 3"):
        SlidingWindowLayer(4).load_recent(keys, values, 10)
    with pytest.raises(CacheShapeError, match="seq_length = 1"):
        SlidingWindowLayer(4).load_recent(keys, values, 1)


def test_crop_after_load_recent_never_reaches_rows_that_were_not_given():
    keys, values = rows(3, seed=1)
    layer = SlidingWindowLayer(4, max_rollback=4)
    layer.load_recent(keys, values, 20)
    layer.crop(20)
    with pytest.raises(CacheCropError, match="no longer holds positions below 17"):
        layer.crop(19)


@pytest.mark.parametrize("block_size", [1, 4])
def test_paged_layers_report_the_positions_of_the_keys_they_gather(block_size):
    config = {"num_hidden_layers": 2, "num_key_value_heads": 3, "head_dim": 4, "sliding_window": 5,
              "layer_types": ["sliding_attention", "full_attention"]}
    cache = PagedCache(32, block_size, config=config, dtype=torch.float32)
    past = 0
    for chunk in (7, 1, 1, 4, 1):
        k, v = rows(chunk, seed=chunk)
        for layer in cache.layers:
            query, key_positions = layer.mask_positions(chunk, None)
            returned, _ = layer.update(k, v)
            assert query.tolist() == list(range(past, past + chunk))
            assert returned.shape[2] == key_positions.numel()
            assert key_positions[-1] == past + chunk - 1
            assert torch.equal(returned[:, :, -chunk:], k)  # the newest rows sit last, in order
        past += chunk
    assert cache.layers[1].mask_positions(1, None)[1].tolist() == list(range(past + 1))  # full: all
    assert cache.layers[0].mask_positions(1, None)[1][0] <= past - 4  # window: its reach, block aligned
