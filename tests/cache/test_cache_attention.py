"""Attention through the cache over a stream of chunks equals attention at once over the whole
sequence with the equivalent mask (causal, or causal ∩ window), for every cache kind,
including left-padded batches with an attention mask (B, past + new)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvcache.cache import make_cache

WINDOW = 4
Q_HEADS, KV_HEADS, DIM = 4, 2, 8
LAYER_TYPES = ["full_attention", "sliding_attention", "full_attention"]
CONFIG = {
    "num_hidden_layers": 3,
    "num_key_value_heads": KV_HEADS,
    "head_dim": DIM,
    "sliding_window": WINDOW,
    "layer_types": LAYER_TYPES,
}
SLIDING_CONFIG = {**CONFIG, "layer_types": None}
# prefill lengths 1, W-1, W+1, 2W+1 and single tokens, crossing the window and growth steps
CHUNKS = [2 * WINDOW + 1, 1, 1, WINDOW - 1, 1, WINDOW + 1, 1, 1, 1, WINDOW, 1]
TOTAL = sum(CHUNKS)


def full_mask(total: int, window: int | None, padding: torch.Tensor | None) -> torch.Tensor:
    """(B or 1, 1, T, T) the mask of attention at once: causal (∩ window), minus padding keys,
    a query always seeing itself."""
    q = torch.arange(total)[:, None]
    p = torch.arange(total)[None, :]
    allowed = p <= q
    if window is not None:
        allowed &= p > q - window
    if padding is None:
        return (allowed | (p == q))[None, None]
    return ((allowed[None] & padding.bool()[:, None, :]) | (p == q)[None])[:, None]


def attend(q, k, v, mask):
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H_q, T_kv, D)
    v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def make(kind: str):
    if kind == "dynamic":
        return make_cache("dynamic", config=CONFIG)
    if kind == "static":
        return make_cache("static", config=CONFIG, max_cache_len=TOTAL + 3)
    if kind == "static_preallocated":
        return make_cache("static", config=CONFIG, max_cache_len=TOTAL, max_batch_size=2, dtype=torch.float32)
    if kind == "paged":  # full and sliding layers: two block tables, the window's blocks given back
        return make_cache("paged", config=CONFIG, num_blocks=64, block_size=4)
    if kind == "paged_sliding":  # every layer windowed, blocks of 3 (misaligned with the window)
        return make_cache("paged", config=SLIDING_CONFIG, num_blocks=64, block_size=3)
    return make_cache("sliding", config=SLIDING_CONFIG)


def windows(kind: str) -> list[int | None]:
    if kind in ("sliding", "paged_sliding"):
        return [WINDOW] * 3
    return [None if t == "full_attention" else WINDOW for t in LAYER_TYPES]


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize(
    "kind", ["dynamic", "static", "static_preallocated", "sliding", "paged", "paged_sliding"]
)
def test_streamed_attention_matches_attention_at_once(kind, padded):
    generator = torch.Generator().manual_seed(7)
    batch = 2
    qs = [torch.randn(batch, Q_HEADS, TOTAL, DIM, generator=generator) for _ in range(3)]
    ks = [torch.randn(batch, KV_HEADS, TOTAL, DIM, generator=generator) for _ in range(3)]
    vs = [torch.randn(batch, KV_HEADS, TOTAL, DIM, generator=generator) for _ in range(3)]
    padding = None
    if padded:
        padding = torch.ones(batch, TOTAL, dtype=torch.long)
        padding[0, :3] = 0  # row 0 is left-padded by 3 tokens
    cache = make(kind)
    outputs = [[] for _ in range(3)]
    start = 0
    for chunk in CHUNKS:
        end = start + chunk
        attention_mask = None if padding is None else padding[:, :end]
        masks = cache.attention_masks(chunk, attention_mask)
        for layer in range(3):
            keys, values = cache.update(ks[layer][:, :, start:end], vs[layer][:, :, start:end], layer)
            outputs[layer].append(attend(qs[layer][:, :, start:end], keys, values, masks[layer]))
        start = end
    for layer, window in enumerate(windows(kind)):
        expected = attend(qs[layer], ks[layer], vs[layer], full_mask(TOTAL, window, padding))
        streamed = torch.cat(outputs[layer], dim=2)
        assert not streamed.isnan().any()
        if kind.startswith("paged") and padding is not None:
            # a paged cache stores no padding: a padding query's output is not defined (only that
            # it is finite); the real queries' outputs are what counts
            real = padding.bool()[:, None, :, None].expand_as(streamed)
            streamed, expected = streamed[real], expected[real]
        torch.testing.assert_close(streamed, expected, atol=1e-5, rtol=0)
    if kind.startswith("paged"):  # a windowed table holds only what its window still needs
        for allocator in cache.allocators:
            allocator.check_invariants()
            if allocator.window is not None:
                held = [sum(b >= 0 for b in allocator.sequence(seq).table) for seq in cache.rows]
                assert max(held) <= -(-(WINDOW - 1) // allocator.block_size) + 1, held


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_nocache_attention_matches_plain_causal(padded):
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(2, Q_HEADS, 6, DIM, generator=generator)
    k = torch.randn(2, KV_HEADS, 6, DIM, generator=generator)
    v = torch.randn(2, KV_HEADS, 6, DIM, generator=generator)
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6]) if padded else None
    cache = make_cache("none")
    mask = cache.attention_masks(6, padding)[0]
    keys, values = cache.update(k, v, 0)
    got = attend(q, keys, values, mask)
    torch.testing.assert_close(got, attend(q, k, v, full_mask(6, None, padding)), atol=1e-5, rtol=0)


def test_sliding_prefill_longer_than_window_matches_full():
    generator = torch.Generator().manual_seed(9)
    total = 3 * WINDOW + 2
    q = torch.randn(1, Q_HEADS, total, DIM, generator=generator)
    k = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    v = torch.randn(1, KV_HEADS, total, DIM, generator=generator)
    cache = make_cache("sliding", window=WINDOW, num_layers=1)
    mask = cache.attention_masks(total)[0]
    keys, values = cache.update(k, v, 0)
    assert keys.shape[2] == total  # the whole chunk, so every query sees its window
    got = attend(q, keys, values, mask)
    torch.testing.assert_close(got, attend(q, k, v, full_mask(total, WINDOW, None)), atol=1e-5, rtol=0)
    assert cache.layers[0].keys.shape[2] == WINDOW
    assert torch.equal(cache.layers[0].keys, k[:, :, -WINDOW:])


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
def test_nocache_from_mixed_config_windows_its_sliding_layers(padded):
    generator = torch.Generator().manual_seed(10)
    total = 2 * WINDOW + 1
    padding = torch.ones(2, total, dtype=torch.long)
    if padded:
        padding[1, :2] = 0
    cache = make_cache("none", config=CONFIG)
    masks = cache.attention_masks(total, padding if padded else None)
    assert len(masks) == 3
    for layer, window in enumerate(windows("mixed")):
        q = torch.randn(2, Q_HEADS, total, DIM, generator=generator)
        k = torch.randn(2, KV_HEADS, total, DIM, generator=generator)
        v = torch.randn(2, KV_HEADS, total, DIM, generator=generator)
        keys, values = cache.update(k, v, layer)
        expected = attend(q, k, v, full_mask(total, window, padding if padded else None))
        got = attend(q, keys, values, masks[layer])
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert masks[0] is masks[2]  # layers of the same kind share one tensor
