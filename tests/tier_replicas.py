"""Engines that share prefix blocks through a tier below the pool, as the tier tests
(tests/tiers/) and the engine tests that use a tier (pins, salts, KV events) build them: a small
pool of BLOCK-token blocks, prompts of seeded random ids, greedy answers of NEW tokens."""

from __future__ import annotations

import random

from kvcache.engine import Engine

BLOCK = 8
NEW = 6


def engine(model, store=None, kv_dtype=None) -> Engine:
    return Engine(model, num_blocks=128, block_size=BLOCK, max_running=4, token_budget=64, kv_store=store,
                  kv_dtype=kv_dtype)


def ids(length: int, seed: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, 1000) for _ in range(length)]


def answer(replica: Engine, prompt: list[int]):
    return replica.generate([prompt], max_tokens=NEW, temperature=0.0, ignore_eos=True)[0]


def flushed(replica: Engine) -> Engine:
    assert replica.store_tier.store.flush()
    return replica
