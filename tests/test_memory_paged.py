"""Paged accounting in the memory planner and `kvcache memory --block-size`: whole blocks per
sequence, and the sequences a budget holds, checked against a PagedCache's real allocation."""

from __future__ import annotations

import json

import pytest
import torch

from kvcache.cli import main
from kvcache.memory import (
    KVShape,
    blocks_for_tokens,
    kv_window_bytes,
    max_paged_sequences,
    max_sequences,
    paged_block_bytes,
    paged_blocks_in_budget,
    paged_kv_cache_bytes,
    paged_pool,
    window_block_bytes,
    window_blocks_per_sequence,
)


def test_paged_bytes_round_each_sequence_up_to_whole_blocks():
    shape = KVShape(layers=4, kv_heads=4, head_dim=32)
    assert [blocks_for_tokens(n, 16) for n in (0, 1, 15, 16, 17)] == [0, 1, 1, 1, 2]
    assert paged_block_bytes(shape, 16, "float32") == 2 * 4 * 4 * 16 * 32 * 4
    assert paged_kv_cache_bytes(shape, 16, 16, dtype="float32") == shape.bytes(16, dtype="float32")
    three = paged_kv_cache_bytes(shape, 17, 16, batch=3, dtype="float32")
    assert three == 3 * shape.bytes(32, dtype="float32")
    # 1000 tokens: 63 blocks of 16 (1008 slots); 1 GiB holds 260 such sequences, 262 unrounded
    assert max_paged_sequences(shape, 2**30, 1000, 16, "float32") == 260
    assert max_sequences(shape, 2**30, 1000, "float32") == 262


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="block_size must be ≥ 1"):
        blocks_for_tokens(10, 0)
    with pytest.raises(ValueError, match="seq_len ≥ 1"):
        max_paged_sequences(KVShape(2, 2, 8), 1000, 0, 4)
    sliding = KVShape(2, 2, 8, sliding_window=4, layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match="paged_pool"):
        paged_blocks_in_budget(sliding, 10_000, 4)
    with pytest.raises(ValueError, match="cannot hold the sliding layers"):
        paged_pool(sliding, 100, 4, max_sequences=16, chunk=64)


@pytest.mark.parametrize(
    "layer_types", [("sliding_attention",) * 3, ("full_attention", "sliding_attention", "full_attention")]
)
@pytest.mark.parametrize("tokens", [1, 5, 6, 7, 8, 13, 30])
def test_windowed_paged_bytes_equal_what_a_paged_cache_holds(layer_types, tokens):
    """A sliding layer holds only its window's blocks: the planner's bytes for one sequence equal
    a real PagedCache's bytes in use after a prefill of that many tokens."""
    torch = pytest.importorskip("torch")
    from kvcache.cache import PagedCache

    shape = KVShape(3, 2, 8, sliding_window=6, layer_types=layer_types)
    config = {
        "num_hidden_layers": 3,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "sliding_window": 6,
        "layer_types": list(layer_types),
    }
    cache = PagedCache(16, 4, config=config, dtype=torch.float32)
    for layer in range(3):
        k = torch.randn(1, 2, tokens, 8)
        cache.update(k, k, layer)
    assert cache.nbytes_used == paged_kv_cache_bytes(shape, tokens, 4, dtype="float32")
    sequences, chunk = 3, 5
    full, window = paged_pool(shape, 50_000, 4, "float32", max_sequences=sequences, chunk=chunk)
    assert window == sequences * window_blocks_per_sequence(6, 4, chunk)
    spent = window * window_block_bytes(shape, 4, "float32") + full * paged_block_bytes(shape, 4, "float32")
    assert spent <= 50_000 and (full == 0 or 50_000 - spent < paged_block_bytes(shape, 4, "float32"))


def test_sequences_in_a_budget_equal_what_a_paged_cache_can_allocate():
    torch = pytest.importorskip("torch")
    from kvcache.cache import OutOfBlocksError, PagedCache

    shape, block_size, tokens, budget = KVShape(2, 2, 8), 16, 37, 100_000
    blocks = budget // paged_block_bytes(shape, block_size, "float32")
    cache = PagedCache(blocks, block_size, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32)
    assert cache.nbytes == blocks * paged_block_bytes(shape, block_size, "float32") <= budget
    fitted = 0
    while True:
        cache.add_sequence()
        try:
            cache.allocator.reserve([cache.rows[-1]], [tokens])
        except OutOfBlocksError:
            break
        fitted += 1
    assert fitted == max_paged_sequences(shape, budget, tokens, block_size, "float32")


def test_cli_memory_block_size(capsys):
    argv = [
        "memory",
        "--layers",
        "4",
        "--kv-heads",
        "4",
        "--head-dim",
        "32",
        "--tokens",
        "1000",
        "--dtype",
        "float32",
        "--budget",
        "1GiB",
        "--block-size",
        "16",
    ]
    assert main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["paged_bytes_per_sequence"] == 63 * 16 * 4096
    assert figures["paged_rounding_bytes_per_sequence"] == 8 * 4096
    assert (figures["max_paged_sequences_of_tokens"], figures["max_sequences_of_tokens"]) == (260, 262)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "paged, blocks of 16 tokens: one sequence 4,128,768 B" in text
    assert "sequences of 1,000 tokens: 260" in text
    assert main([*argv[:-2], "--window", "8", "--block-size", "16"]) == 2
    assert "sliding-window layers" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_full_precision_windows_bytes_are_what_a_paged_cache_holds_for_its_rows(dtype):
    from kvcache.cache import PagedCache

    shape = KVShape(layers=3, kv_heads=2, head_dim=8)
    cache = PagedCache(16, 4, num_layers=3, kv_heads=2, head_dim=8, dtype=dtype, kv_dtype="int8", kv_window=5)
    for _ in range(3):
        cache.add_sequence()
    cache.begin(2)
    for layer in cache.layers:
        layer.update(torch.randn(3, 2, 2, 8, dtype=dtype), torch.randn(3, 2, 2, 8, dtype=dtype))
    name = str(dtype).removeprefix("torch.")
    assert cache.recent.nbytes == kv_window_bytes(shape, 5, name, sequences=3)
    with pytest.raises(ValueError, match="window"):
        kv_window_bytes(shape, -1, name)
