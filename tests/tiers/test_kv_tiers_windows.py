"""Sliding-window and hybrid models in the tiers below the pool: a block is stored while every
layer group still holds it (a window gives back the blocks it has passed), and a prefix read back
is written into every group, the window's old positions then given back; the answers equal a run
without any cache, and the hits are counted, for prompts shorter and longer than the window."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model

from kvcache.engine import Engine
from kvcache.generation.params import SamplingParams
from kvcache.tiers.disk_store import DiskBlockStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

BLOCK, WINDOW = 8, 24
MODELS = {
    "sliding (mistral)": dict(model_type="mistral", sliding_window=WINDOW),
    "hybrid (gemma2)": dict(model_type="gemma2", sliding_window=WINDOW, head_dim=16,
                            query_pre_attn_scalar=16),
}


def _engine(model, store=None) -> Engine:
    # chunks of 16 tokens: a block completed in a chunk is still inside the window when offered
    return Engine(model, num_blocks=64, block_size=BLOCK, max_running=2, token_budget=16, kv_store=store)


def _answer(replica: Engine, prompt: list[int]):
    return replica.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]


@pytest.mark.parametrize("length", [21, 57])  # shorter and longer than the window
@pytest.mark.parametrize("family", list(MODELS))
def test_a_windowed_model_reads_its_prefix_back_from_disk_with_the_same_answer(tmp_path, family, length):
    model = tiny_model(layers=2, vocab=256, **MODELS[family])
    prompt = [(7 * i + 3) % 250 + 1 for i in range(length)]
    cold = _answer(_engine(model), prompt)
    writer = _engine(model, DiskBlockStore(tmp_path))
    assert _answer(writer, prompt).tokens == cold.tokens
    assert writer.store_tier.store.flush()
    writer.close()
    reader = _engine(model, DiskBlockStore(tmp_path))  # a restart: nothing in the pool
    warm = _answer(reader, prompt)
    assert warm.tokens == cold.tokens
    whole_blocks = (length - 1) // BLOCK
    assert warm.usage.cached_tokens == whole_blocks * BLOCK
    assert reader.stats()["kv_store"]["hit_blocks"] == whole_blocks
    for allocator in reader.pool.cache.allocators:
        allocator.check_invariants()
    reader.close()


def test_a_full_precision_window_caps_what_a_disk_read_loads(tmp_path):
    # --kv-window: a prompt's last kv_window tokens are computed again, never taken from a cache
    # hit; a read from the disk tier keeps to the same cap as a hit in the pool
    model = tiny_model(layers=2, vocab=256)
    prompt = [(5 * i + 1) % 250 + 1 for i in range(41)]

    def engine(store=None) -> Engine:
        return Engine(model, num_blocks=64, block_size=BLOCK, max_running=2, token_budget=64,
                      kv_dtype="int8", kv_window=16, kv_store=store)

    cold = _answer(engine(), prompt)
    writer = engine(DiskBlockStore(tmp_path))
    assert _answer(writer, prompt).tokens == cold.tokens
    assert writer.store_tier.store.flush()
    writer.close()
    reader = engine(DiskBlockStore(tmp_path))  # a restart: nothing in the pool
    warm = _answer(reader, prompt)
    cap = reader.pool.cache.reusable_tokens(len(prompt))  # 41 - 16 = 25: three blocks of 8
    assert warm.tokens == cold.tokens
    assert warm.usage.cached_tokens == cap // BLOCK * BLOCK
    assert reader.stats()["kv_store"]["hit_blocks"] == cap // BLOCK
    reader.close()
