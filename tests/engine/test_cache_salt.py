"""cache_salt (vLLM's field): requests of different salts never share a cached block, in the pool
or in a tier below it, and every answer is the one without sharing."""

from __future__ import annotations

import pytest
from tier_replicas import BLOCK, NEW, engine, flushed, ids

import kvcache
from kvcache.blocks import ROOT_HASH, salt_root
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.tiers.disk_store import DiskBlockStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


def _answer(replica, prompt, salt=None):
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, cache_salt=salt)
    return replica.generate([prompt], params)[0]


def test_only_requests_of_the_same_salt_share_the_pool(model):
    replica, prompt = engine(model), ids(40, seed=5)
    first = _answer(replica, prompt, salt="tenant-a")
    shared = len(prompt) - 1  # whole blocks, then the leading tokens of the next: all but the last
    for salt, cached in (("tenant-b", 0), (None, 0), ("tenant-a", shared)):
        again = _answer(replica, prompt, salt)
        assert again.usage.cached_tokens == cached, salt
        assert again.tokens == first.tokens
    assert _answer(replica, prompt).usage.cached_tokens == shared  # the unsalted one's own blocks


def test_a_salt_keeps_its_blocks_apart_in_a_tier_below_the_pool(model, tmp_path):
    prompt = ids(40, seed=6)
    writer = engine(model, DiskBlockStore(tmp_path))
    first = _answer(writer, prompt, salt="tenant-a")
    flushed(writer).close()
    for salt, cached in (("tenant-b", 0), ("tenant-a", 4 * BLOCK)):
        reader = engine(model, DiskBlockStore(tmp_path))  # a restart: only the disk holds blocks
        again = _answer(reader, prompt, salt)
        assert again.usage.cached_tokens == cached and again.tokens == first.tokens
        flushed(reader).close()


def test_a_salt_is_a_short_string_and_roots_differ_by_salt():
    assert salt_root(None) == ROOT_HASH and salt_root("a") != salt_root("b") != ROOT_HASH
    for bad in ("", 7, "x" * 257, "\ud800"):
        with pytest.raises(RequestError, match="cache_salt"):
            SamplingParams(cache_salt=bad)
