"""The disk tier: a prefix cache that survives a restart. Blocks written by one engine are read
by a new one on the same folder, with tokens equal to a run without any cache; a damaged,
truncated or foreign file is refused and recomputed; a writer killed mid-write leaves whole
files only; a second process on the folder is refused; disk then Redis as one tiered store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
from redis_server import RedisServer
from tier_replicas import BLOCK, NEW, answer, engine, flushed, ids
from waiting import wait_for

import kvcache
from kvcache.tiers.disk_store import DiskBlockStore
from kvcache.tiers.redis_store import RedisBlockStore
from kvcache.tiers.tiered_store import TieredStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


def _files(folder) -> list:
    return sorted(path for path in folder.rglob("*.kvb"))


def test_blocks_survive_a_restart_and_answer_as_a_run_without_cache(model, tmp_path):
    prompt = ids(40, seed=1)
    first = engine(model, DiskBlockStore(tmp_path))
    cold = answer(first, prompt)
    flushed(first).close()
    assert len(_files(tmp_path)) == 5  # the 40 prompt tokens and 5 of the reply: 5 full blocks
    restarted = engine(model, DiskBlockStore(tmp_path))  # a new process's view: indexed from names
    warm = answer(restarted, prompt)
    assert warm.tokens == cold.tokens and warm.usage.cached_tokens == 4 * BLOCK  # all but the last token's
    assert restarted.stats()["kv_store"]["hit_blocks"] == 4
    restarted.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign"])
def test_a_damaged_or_foreign_file_is_refused_deleted_and_recomputed(model, tmp_path, damage, caplog):
    prompt = ids(40, seed=2)
    writer = engine(model, DiskBlockStore(tmp_path))
    cold = answer(writer, prompt)
    flushed(writer).close()
    files = _files(tmp_path)
    if damage == "flip":
        raw = bytearray(files[0].read_bytes())
        raw[-3] ^= 0x10
        files[0].write_bytes(bytes(raw))
    elif damage == "truncate":
        files[0].write_bytes(files[0].read_bytes()[:-100])
    else:  # the same tokens' block written for another model, copied under this model's name
        other = kvcache.load_model()
        other.model.layers[0].self_attn.k_proj.weight.data *= 1.5  # other weights: another namespace
        elsewhere = engine(other, DiskBlockStore(tmp_path / "other"))
        answer(elsewhere, prompt)
        flushed(elsewhere).close()
        foreign = _files(tmp_path / "other")
        files[0].write_bytes(next(f for f in foreign if f.name == files[0].name).read_bytes())
    reader = engine(model, DiskBlockStore(tmp_path))
    with caplog.at_level("WARNING", logger="kvcache.store"):
        warm = answer(reader, prompt)
    assert warm.tokens == cold.tokens
    assert reader.stats()["kv_store"]["invalid_blocks"] >= 1
    flushed(reader)
    assert files[0].exists() and files[0].read_bytes() != b""  # deleted, then written again whole
    reader.close()


def test_a_second_store_on_a_folder_in_use_is_refused_by_name(tmp_path):
    first = DiskBlockStore(tmp_path)
    with pytest.raises(ValueError, match="another kvcache process uses the KV disk folder"):
        DiskBlockStore(tmp_path)
    first.close()
    DiskBlockStore(tmp_path).close()  # free again once closed


def test_the_folder_stays_within_its_size_least_recently_used_first(model, tmp_path):
    store = DiskBlockStore(tmp_path)
    replica = engine(model, store)
    answer(replica, ids(40, seed=3))
    flushed(replica)
    block_bytes = _files(tmp_path)[0].stat().st_size
    replica.close()
    small = DiskBlockStore(tmp_path, max_bytes=3 * block_bytes)  # indexed: the oldest go at once
    assert small.blocks() == 3 and small.bytes <= 3 * block_bytes and len(_files(tmp_path)) == 3
    small.close()


def test_a_writer_killed_mid_write_leaves_whole_blocks_only(tmp_path):
    size = 1 << 20
    script = textwrap.dedent(f"""
        import os
        from kvcache.tiers.disk_store import DiskBlockStore
        store = DiskBlockStore({str(tmp_path)!r})
        index = 0
        while True:
            key = "kvcache:" + "ab" * 16 + ":" + format(index, "032x")
            store.put(key, lambda: os.urandom({size}))
            index += 1
            if index % 64 == 0:
                store.flush(60)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_for(lambda: len(_files(tmp_path)) >= 20, timeout=120)
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(30)
    store = DiskBlockStore(tmp_path)  # the lock died with the process
    assert not list(tmp_path.rglob("*.tmp"))  # a killed write's temporary file is cleaned up
    assert all(path.stat().st_size == size for path in _files(tmp_path))
    assert store.blocks() == len(_files(tmp_path)) >= 20
    store.close()


def test_disk_then_redis_read_as_one_store_and_a_redis_hit_is_promoted_to_disk(model, tmp_path):
    redis_server = RedisServer().start()
    try:
        prompt = ids(40, seed=4)
        writer = engine(model, redis_server.url)
        cold = answer(writer, prompt)
        flushed(writer).close()
        tiered = TieredStore([DiskBlockStore(tmp_path), RedisBlockStore(redis_server.url)])
        second = engine(model, tiered)
        assert answer(second, prompt).tokens == cold.tokens  # from Redis
        stats = second.stats()["kv_store"]
        assert stats["hit_blocks"] == 4 and stats["tiers"][redis_server.url]["read_bytes"] > 0
        flushed(second).close()
        assert len(_files(tmp_path)) >= 4  # promoted (and the reply's own block written)
        disk_only = engine(model, DiskBlockStore(tmp_path))
        warm = answer(disk_only, prompt)
        assert warm.tokens == cold.tokens and warm.usage.cached_tokens == 4 * BLOCK
        disk_only.close()
    finally:
        redis_server.stop()
    assert NEW > 0


@pytest.mark.parametrize("kv_dtype, other, share", [("int8", "int4", 0.3), ("int4", None, 0.3),
                                                   ("fp8/bfloat16", "int8", 0.4)])
def test_quantized_blocks_go_through_disk_and_redis_packed_and_never_into_another_dtypes_pool(
    model, tmp_path, kv_dtype, other, share
):
    """A quantized pool's blocks are stored as their packed bytes (smaller files and Redis values
    than float32's), read back by a restarted engine on disk then Redis with the answer a cold
    quantized engine gives, and never read by an engine whose pool stores another dtype."""
    redis_server = RedisServer().start()
    try:
        prompt = ids(40, seed=6)
        both = TieredStore([DiskBlockStore(tmp_path), RedisBlockStore(redis_server.url)])
        cold_engine = engine(model, both, kv_dtype)
        cold = answer(cold_engine, prompt)
        flushed(cold_engine).close()
        layout = cold_engine.store_tier.layout
        float_bytes = engine(model).pool.block_bytes  # (a float32 pool's block, its header aside)
        assert layout.kv_dtype == kv_dtype and layout.payload_bytes < float_bytes * share
        assert {path.stat().st_size for path in _files(tmp_path)} == {layout.value_bytes}
        for tiers in ([DiskBlockStore(tmp_path)], [RedisBlockStore(redis_server.url)]):  # each alone
            warm_engine = engine(model, tiers[0], kv_dtype)
            warm = answer(warm_engine, prompt)
            assert warm.tokens == cold.tokens and warm.usage.cached_tokens == 4 * BLOCK
            warm_engine.close()
        other_dtype = engine(model, DiskBlockStore(tmp_path), other)
        answer(other_dtype, prompt)
        assert other_dtype.stats()["kv_store"]["hit_blocks"] == 0
        other_dtype.close()
    finally:
        redis_server.stop()


@pytest.mark.parametrize("fault", ["disk full", "unwritable folder"])
def test_a_disk_that_cannot_take_writes_is_skipped_with_one_log_line(model, tmp_path, fault, monkeypatch,
                                                                    caplog):
    import errno

    from kvcache.tiers import disk_store

    store = DiskBlockStore(tmp_path, retry_s=3600)
    if fault == "disk full":
        def full(descriptor, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(disk_store, "_write_all", full)
    replica, cold = engine(model, store), engine(model)
    if fault == "unwritable folder":  # every namespace folder is a file: nothing can go under it
        (tmp_path / replica.store_tier.space).write_bytes(b"")
    with caplog.at_level("WARNING", logger="kvcache.store"):
        for seed in (9, 10):
            prompt = ids(40, seed=seed)
            assert answer(replica, prompt).tokens == answer(cold, prompt).tokens
            store.flush()
    assert store.counters.errors >= 1 and not store.counters.up and store.counters.written_blocks == 0
    assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    assert not list(tmp_path.rglob("*.tmp"))
    replica.close()


def test_writes_keep_to_the_write_rate(tmp_path):
    import time

    store = DiskBlockStore(tmp_path, write_bytes_per_s=4 << 20)
    block = os.urandom(1 << 20)
    started = time.monotonic()
    for index in range(6):
        assert store.put("kvcache:" + "cd" * 16 + ":" + format(index, "032x"), lambda: block)
    assert store.flush(60)
    assert time.monotonic() - started >= 1.0  # 6 MiB at 4 MiB/s (a lower bound: load only adds)
    assert store.blocks() == 6
    store.close()


def test_a_read_error_on_a_block_is_a_miss_failing_neither_request_nor_tier(model, tmp_path, monkeypatch):
    import errno

    from kvcache.tiers import disk_store

    prompt = ids(40, seed=11)
    writer = engine(model, DiskBlockStore(tmp_path))
    cold = answer(writer, prompt)
    flushed(writer).close()

    def broken(*arguments):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(disk_store, "_read_file", broken)
    reader = engine(model, DiskBlockStore(tmp_path))
    warm = answer(reader, prompt)
    assert warm.finish_reason == "length" and warm.tokens == cold.tokens  # computed instead
    stats = reader.stats()["kv_store"]
    assert stats["errors"] == 0 and stats["up"] and stats["invalid_blocks"] >= 1  # the block, not the tier
    reader.close()


def test_a_block_already_on_disk_is_not_written_again(tmp_path):
    key = "kvcache:" + "ab" * 16 + ":" + "01" * 16
    store = DiskBlockStore(tmp_path)
    try:
        assert store.put(key, lambda: b"x" * 64) and store.flush()
        made: list[int] = []
        assert store.put(key, lambda: made.append(1) or b"x" * 64) and store.flush()  # held: True
        assert store.counters.written_blocks == 1 and not made
    finally:
        store.close()


def test_a_disk_read_that_failed_does_not_make_every_block_offered_again(model, tmp_path):
    # a read timing out loses no block the disk took: after one, the blocks it holds are not
    # queued again (only a failed write, which drops blocks, makes TierConnector offer everything)
    prompt = ids(40, seed=12)
    replica = engine(model, DiskBlockStore(tmp_path, retry_s=0.0))
    answer(replica, prompt)
    store = flushed(replica).store_tier.store
    store.failed(TimeoutError("a block not read in time"), "reading a block")  # as read_block does
    offered: list[str] = []
    putting = store.put
    store.put = lambda key, make_value: offered.append(key) or putting(key, make_value)
    try:
        answer(replica, prompt)  # the same blocks again
        assert offered == []
    finally:
        replica.close()
