"""Pinned prefixes: their blocks are evicted last, in the pool and in the disk tier, so a shared
system prompt survives traffic that would otherwise push it out."""

from __future__ import annotations

import pytest
from tier_replicas import BLOCK, NEW, answer, flushed, ids

import kvcache
from kvcache.engine import Engine
from kvcache.tiers.disk_store import DiskBlockStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_prompt_keeps_its_blocks_through_traffic_that_fills_the_pool(model, pinned):
    replica = Engine(model, num_blocks=16, block_size=BLOCK, max_running=1, token_budget=64)
    system = ids(33, seed=7)  # four whole blocks
    if pinned:
        assert replica.pin(system) == 4 * BLOCK
    first = answer(replica, system)
    for seed in range(3):  # each fills most of the pool
        answer(replica, ids(80, seed=100 + seed))
    again = answer(replica, system)
    assert again.tokens == first.tokens
    assert again.usage.cached_tokens == (4 * BLOCK if pinned else 0)


def test_the_disk_tier_evicts_pinned_blocks_last(model, tmp_path):
    system = ids(33, seed=8)
    writer = Engine(model, num_blocks=64, block_size=BLOCK, max_running=1, token_budget=64,
                    kv_store=DiskBlockStore(tmp_path))
    writer.pin(system)
    answer(writer, system)
    flushed(writer)
    block_bytes = writer.store_tier.store.bytes // writer.store_tier.store.blocks()
    writer.close()
    small = DiskBlockStore(tmp_path, max_bytes=6 * block_bytes)
    replica = Engine(model, num_blocks=64, block_size=BLOCK, max_running=1, token_budget=64, kv_store=small)
    replica.pin(system)
    for seed in range(2):  # newer blocks than the system prompt's, more than the folder holds
        answer(replica, ids(40, seed=200 + seed))
        flushed(replica)
    replica.close()
    restarted = Engine(model, num_blocks=64, block_size=BLOCK, max_running=1, token_budget=64,
                       kv_store=DiskBlockStore(tmp_path, max_bytes=6 * block_bytes))
    assert answer(restarted, system).usage.cached_tokens == 4 * BLOCK
    restarted.close()
    assert NEW > 0
