"""Paged accounting in the memory planner and `kvcache memory --block-size`: whole blocks per
sequence, and the sequences a budget holds, checked against a PagedCache's real allocation."""

from __future__ import annotations

import json

import pytest

from kvcache.cli import main
from kvcache.memory import (
    KVShape,
    blocks_for_tokens,
    max_paged_sequences,
    max_sequences,
    paged_block_bytes,
    paged_kv_cache_bytes,
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


def test_paged_figures_refuse_sliding_layers_and_bad_sizes():
    sliding = KVShape(2, 2, 8, sliding_window=4, layer_types=("sliding_attention",) * 2)
    with pytest.raises(ValueError, match="sliding-window layers"):
        paged_kv_cache_bytes(sliding, 10, 4)
    with pytest.raises(ValueError, match="block_size must be ≥ 1"):
        blocks_for_tokens(10, 0)
    with pytest.raises(ValueError, match="seq_len ≥ 1"):
        max_paged_sequences(KVShape(2, 2, 8), 1000, 0, 4)


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
    argv = ["memory", "--layers", "4", "--kv-heads", "4", "--head-dim", "32", "--tokens", "1000",
            "--dtype", "float32", "--budget", "1GiB", "--block-size", "16"]
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
