"""The disk tier against a folder a stranger can plant things in: links are never followed out of
the folder (at the scan, on eviction, at the writer's temporary name, on the lock file, on a
refresh); a read that stalls is a miss within the store's deadline and never keeps a program from
exiting; a bad block that cannot be deleted is a miss, logged once and never read again; the
folder and its files are private; a full disk stops writes, not reads; a huge sparse file, a
folder named like a block and an empty folder path are each handled by name."""

from __future__ import annotations

import errno
import os
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from tier_replicas import answer, engine, flushed, ids
from waiting import wait_for

import kvcache
from kvcache.tiers import disk_store
from kvcache.tiers.disk_store import DiskBlockStore

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

SPACE = "ab" * 16
SIZE = 4096


def _key(index: int, space: str = SPACE) -> str:
    return f"kvcache:{space}:{index:032x}"


def _name(index: int) -> str:
    return f"{index:032x}.kvb"


def _value(index: int) -> bytes:
    return bytes([index % 251]) * SIZE


def _stored(store: DiskBlockStore, indexes) -> DiskBlockStore:
    for index in indexes:
        assert store.put(_key(index), lambda index=index: _value(index))
    assert store.flush(30)
    return store


def _read(store: DiskBlockStore, indexes, size: int = SIZE) -> list[bytes] | None:
    """The bytes of the leading run of `indexes` the store holds (each copied as it is read)."""
    pending = store.start_read([_key(index) for index in indexes], size)
    assert pending is not None
    pending.wait(30)
    values = pending.values()
    return None if values is None else [bytes(value.read()) for value in values]


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


# ---- 1. links ----------------------------------------------------------------------------------------
def test_a_linked_namespace_folder_is_never_descended_at_the_scan(tmp_path):
    folder, outside = tmp_path / "kv", tmp_path / "outside"
    folder.mkdir()
    outside.mkdir()
    (outside / "notes.tmp").write_bytes(b"keep")
    (outside / _name(1)).write_bytes(_value(1))
    (folder / SPACE).symlink_to(outside, target_is_directory=True)
    store = DiskBlockStore(folder, max_bytes=1)  # over its size: anything indexed would be evicted
    try:
        assert store.blocks() == 0
        assert (outside / "notes.tmp").read_bytes() == b"keep" and (outside / _name(1)).exists()
    finally:
        store.close()


def test_eviction_never_deletes_through_a_namespace_folder_swapped_for_a_link(tmp_path, caplog):
    folder, outside = tmp_path / "kv", tmp_path / "outside"
    store = _stored(DiskBlockStore(folder, max_bytes=3 * SIZE), range(3))
    try:
        (folder / SPACE).rename(tmp_path / "moved")
        outside.mkdir()
        for index in range(3):
            (outside / _name(index)).write_bytes(b"not yours")
        (folder / SPACE).symlink_to(outside, target_is_directory=True)
        with caplog.at_level("WARNING", logger="kvcache.store"):
            store.put(_key(7, "cd" * 16), lambda: _value(7))  # another namespace: evicts the oldest
            assert store.flush(30)
        assert all((outside / _name(index)).read_bytes() == b"not yours" for index in range(3))
        assert store.blocks() <= 3
    finally:
        store.close()


def test_the_writer_never_writes_through_a_link_planted_at_a_temporary_name(tmp_path):
    folder, victim = tmp_path / "kv", tmp_path / "victim"
    victim.write_bytes(b"precious")
    store = DiskBlockStore(folder)
    (folder / SPACE).mkdir()
    for name in (f"{_name(1)}.{os.getpid()}.tmp", f"{_name(1)}.tmp"):  # after the scan, at every name
        (folder / SPACE / name).symlink_to(victim)                   # one could guess
    _stored(store, [1])
    try:
        assert victim.read_bytes() == b"precious"
        assert _read(store, [1]) == [_value(1)]
        assert stat.S_ISREG(os.lstat(folder / SPACE / _name(1)).st_mode)
    finally:
        store.close()


@pytest.mark.parametrize("planted", ["before the scan", "after the scan"])
def test_a_block_that_is_a_link_is_neither_read_nor_refreshed(tmp_path, planted):
    folder, outside = tmp_path / "kv", tmp_path / "outside.kvb"
    _stored(DiskBlockStore(folder), [1, 2]).close()
    outside.write_bytes(_value(1))  # a valid block's bytes, outside the folder
    os.utime(outside, (1_000_000, 1_000_000))
    store = DiskBlockStore(folder) if planted == "after the scan" else None
    (folder / SPACE / _name(1)).unlink()
    (folder / SPACE / _name(1)).symlink_to(outside)
    store = store or DiskBlockStore(folder)
    try:
        assert _read(store, [1, 2]) == []  # the run ends at the link: a miss, not a hit from outside
        assert os.stat(outside).st_mtime == 1_000_000 and outside.read_bytes() == _value(1)
    finally:
        store.close()


def test_a_lock_file_that_is_a_link_is_refused_naming_the_folder_and_not_followed(tmp_path):
    folder, target = tmp_path / "kv", tmp_path / "elsewhere" / "created"
    folder.mkdir()
    target.parent.mkdir()
    (folder / ".lock").symlink_to(target)
    with pytest.raises(ValueError, match=r"--kv-disk.*\.lock.*link|\.lock.*link.*--kv-disk"):
        DiskBlockStore(folder)
    assert not target.exists()


# ---- 2. a read that stalls ---------------------------------------------------------------------------
def test_a_block_read_that_stalls_is_a_miss_within_the_deadline_not_a_frozen_step(model, tmp_path,
                                                                                     monkeypatch):
    prompt = ids(40, seed=21)
    writer = engine(model, DiskBlockStore(tmp_path))
    cold = answer(writer, prompt)
    flushed(writer).close()
    release = threading.Event()
    reading = disk_store._read_file

    def stalled(*arguments):
        release.wait()  # a file that does not answer until the test ends
        return reading(*arguments)

    monkeypatch.setattr(disk_store, "_read_file", stalled)
    reader = engine(model, DiskBlockStore(tmp_path, timeout_s=0.5))
    done: list = []
    worker = threading.Thread(target=lambda: done.append(answer(reader, prompt)), daemon=True)
    try:
        worker.start()
        worker.join(timeout=60)  # the stall lasts until release: far past this bound
        assert done, "the request waited on a stalled disk read"
        assert done[0].tokens == cold.tokens and done[0].usage.cached_tokens == 0
        assert reader.stats()["kv_store"]["errors"] >= 1  # the tier, not the request, failed
    finally:
        release.set()
        worker.join(timeout=60)
        reader.close()


def test_a_load_waits_one_deadline_for_all_its_blocks_not_one_a_block(model, tmp_path, monkeypatch):
    # every block answers within the store's timeout, slowly: a step loading many of them waits
    # timeout_s in all, the rest computed, instead of blocks x timeout_s
    prompt = ids(120, seed=22)  # 14 whole blocks of 8
    writer = engine(model, DiskBlockStore(tmp_path))
    cold = answer(writer, prompt)
    flushed(writer).close()
    reading, slow = disk_store._read_file, 0.4

    def slowly(*arguments):
        time.sleep(slow)  # (a slow disk: each block answers, after a while)
        return reading(*arguments)

    monkeypatch.setattr(disk_store, "_read_file", slowly)
    reader = engine(model, DiskBlockStore(tmp_path, timeout_s=1.0))
    try:
        warm = answer(reader, prompt)
        assert warm.tokens == cold.tokens
        assert 0 < reader.stats()["kv_store"]["hit_blocks"] <= 1.0 // slow  # what fits in one timeout_s
    finally:
        reader.close()


def test_a_fifo_in_place_of_a_block_is_refused_at_once_and_the_tier_stays_up(tmp_path):
    store = _stored(DiskBlockStore(tmp_path / "kv", timeout_s=5.0), [1, 2])
    fifo = tmp_path / "kv" / SPACE / _name(2)
    fifo.unlink()
    os.mkfifo(fifo)  # after the scan: indexed as a block, opening it for reading blocks
    try:
        assert _read(store, [1, 2]) == [_value(1)]  # the run ends at the FIFO
        assert store.counters.errors == 0 and store.counters.up
    finally:
        try:  # a reader stuck in open() (before the fix) is let go
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        store.close()


def test_a_library_program_exits_while_a_disk_read_is_stuck(tmp_path):
    script = textwrap.dedent(f"""
        import threading
        from kvcache.tiers import disk_store
        from kvcache.tiers.disk_store import DiskBlockStore
        key = "kvcache:" + "ab" * 16 + ":" + "01" * 16
        stuck = threading.Event()  # never set
        loading = DiskBlockStore({str(tmp_path / "a")!r}, timeout_s=0.3)
        loading.put(key, lambda: b"x" * 64)
        assert loading.flush(30)
        found = loading.start_read([key], 64)
        found.wait(30)
        block = found.values()[0]
        disk_store._read_file = lambda *arguments: stuck.wait()  # a step's read stuck in open()
        assert block.read() is None  # past the deadline: a miss
        finding = DiskBlockStore({str(tmp_path / "b")!r}, timeout_s=0.3)
        finding._read_run = lambda *arguments: stuck.wait()  # a queued request's read stuck too
        finding.start_read([key], 64).wait(0.3)
        print("done", flush=True)
    """)
    try:
        finished = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("the program did not exit: a thread stuck in a disk read held it")
    assert finished.returncode == 0, finished.stderr
    assert "done" in finished.stdout


# ---- 3. a bad block that cannot be deleted -----------------------------------------------------------
def _refuse_unlink(monkeypatch, name: str) -> list:
    refused: list = []
    unlink = os.unlink

    def refusing(path, *arguments, **options):
        if os.fsdecode(path).endswith(name):
            refused.append(path)
            raise PermissionError(errno.EPERM, "Operation not permitted", os.fsdecode(path))
        return unlink(path, *arguments, **options)

    monkeypatch.setattr(os, "unlink", refusing)
    return refused


def test_a_corrupt_block_that_cannot_be_deleted_is_a_miss_logged_once_and_never_read_again(
    model, tmp_path, monkeypatch, caplog
):
    prompt = ids(40, seed=22)
    writer = engine(model, DiskBlockStore(tmp_path))
    cold = answer(writer, prompt)
    flushed(writer).close()
    corrupt = {}
    for path in tmp_path.rglob("*.kvb"):  # every block flipped: the first one read fails its check
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x10
        path.write_bytes(bytes(raw))
        corrupt[path.name] = bytes(raw)
    refused = _refuse_unlink(monkeypatch, ".kvb")
    store = DiskBlockStore(tmp_path)
    reader = engine(model, store)
    try:
        with caplog.at_level("WARNING", logger="kvcache.store"):
            warm = answer(reader, prompt)
            assert warm.finish_reason == "length" and warm.tokens == cold.tokens
            assert wait_for(lambda: refused)  # (deleted off the step, on the store's reader thread)
            assert len({os.fsdecode(path) for path in refused}) == 1
            name = os.path.basename(os.fsdecode(refused[0]))
            bad = next(path for path in tmp_path.rglob("*.kvb") if path.name == name)
            invalid = store.counters.invalid_blocks
            pending = store.start_read([f"kvcache:{bad.parent.name}:{bad.stem}"], len(corrupt[bad.name]))
            pending.wait(30)
            assert pending.values() == [] and store.counters.invalid_blocks == invalid  # not read again
            assert flushed(reader) and bad.read_bytes() == corrupt[bad.name]  # nor written over
        assert len([r for r in caplog.records if "cannot be deleted" in r.getMessage()]) == 1
        assert store.counters.up
    finally:
        reader.close()


def test_a_truncated_block_that_cannot_be_deleted_leaves_the_tier_up_at_every_start(tmp_path, monkeypatch):
    _stored(DiskBlockStore(tmp_path), [1, 2]).close()
    truncated = tmp_path / SPACE / _name(1)
    truncated.write_bytes(_value(1)[:-100])
    _refuse_unlink(monkeypatch, _name(1))
    for _ in range(2):  # two starts
        store = DiskBlockStore(tmp_path)
        try:
            assert _read(store, [1, 2]) == []
            assert _read(store, [2]) == [_value(2)]
            assert store.counters.up and store.counters.errors == 0 and store.available()
        finally:
            store.close()
    assert truncated.exists()


# ---- 4. private files -------------------------------------------------------------------------------
def test_the_folder_and_its_files_are_private_whatever_the_umask(tmp_path):
    folder = tmp_path / "kv"
    previous = os.umask(0)
    try:
        store = _stored(DiskBlockStore(folder), [1])
    finally:
        os.umask(previous)
    try:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / SPACE).stat().st_mode) == 0o700
        assert stat.S_IMODE((folder / SPACE / _name(1)).stat().st_mode) == 0o600
        assert stat.S_IMODE((folder / ".lock").stat().st_mode) == 0o600
    finally:
        store.close()


# ---- 5. a full disk ---------------------------------------------------------------------------------
def test_a_full_disk_stops_writes_and_evicts_but_reads_go_on(tmp_path, monkeypatch, caplog):
    store = _stored(DiskBlockStore(tmp_path, retry_s=3600), [1])
    _stored(store, [2])
    _stored(store, [3])  # least recently used first: 1, 2, 3

    def full(*arguments):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_store, "_write_all", full, raising=False)
    monkeypatch.setattr(Path, "write_bytes", full)  # (how blocks were written before _write_all)
    try:
        with caplog.at_level("WARNING", logger="kvcache.store"):
            assert store.put(_key(4), lambda: _value(4))
            assert store.flush(30)
            assert not store.put(_key(5), lambda: _value(5))  # writes stopped for retry_s
        assert store.counters.errors == 1 and store.counters.dropped_blocks == 2
        assert store.available()  # reads go on
        assert _read(store, [2]) == [_value(2)] and _read(store, [3]) == [_value(3)]
        assert _read(store, [1]) == [] and not (tmp_path / SPACE / _name(1)).exists()  # room given back
        assert len([r for r in caplog.records if "unavailable" in r.getMessage()]) == 1
    finally:
        store.close()


# ---- 6, 7, 8. files that are not blocks, an empty path ------------------------------------------------
@pytest.mark.parametrize("size", [1 << 40, 6 * SIZE])
def test_a_huge_sparse_file_with_a_future_mtime_evicts_no_real_block(tmp_path, size):
    _stored(DiskBlockStore(tmp_path), [1, 2, 3]).close()
    planted = tmp_path / SPACE / _name(9)
    with open(planted, "wb") as handle:
        handle.truncate(size)  # sparse: takes no room
    future = time.time() + 365 * 86400
    os.utime(planted, (future, future))
    store = DiskBlockStore(tmp_path, max_bytes=8 * SIZE)
    try:
        assert all((tmp_path / SPACE / _name(index)).exists() for index in (1, 2, 3))
        assert _read(store, [1, 2, 3]) == [_value(1), _value(2), _value(3)]
        assert store.bytes <= store.max_bytes
    finally:
        store.close()


def test_folders_named_like_blocks_or_temporary_files_are_skipped_at_start(tmp_path):
    (tmp_path / SPACE / _name(1)).mkdir(parents=True)
    (tmp_path / SPACE / "left.tmp").mkdir()
    store = DiskBlockStore(tmp_path, max_bytes=1)  # over its size: a folder indexed would be evicted
    try:
        assert store.blocks() == 0
        assert (tmp_path / SPACE / _name(1)).is_dir() and (tmp_path / SPACE / "left.tmp").is_dir()
        assert store.counters.up
    finally:
        store.close()


def test_an_empty_folder_path_is_refused_naming_the_flag(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="--kv-disk"):
        DiskBlockStore("")
    assert not (tmp_path / ".lock").exists()


def test_serve_with_an_empty_kv_disk_is_a_usage_error_naming_the_flag(tmp_path, monkeypatch, capsys):
    from kvcache.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # (a usage error: argparse's exit, before anything loads)
        main(["serve", "--port", "0", "--kv-disk", ""])
    assert exit_.value.code == 2
    assert "--kv-disk" in capsys.readouterr().err
    assert not (tmp_path / ".lock").exists()


@pytest.mark.parametrize("where", ["_open_block", "_read_file"])
def test_one_block_file_that_fails_is_a_miss_and_the_tier_stays_up(tmp_path, monkeypatch, where):
    # EACCES/EIO on one file (found by a read, or read by a step's load) is that block's problem,
    # not the tier's: the other blocks are still read, and the file is deleted to be written again
    store = _stored(DiskBlockStore(tmp_path / "kv"), [1, 2, 3])
    real = getattr(disk_store, where)

    def failing(root, space, name, *rest):
        if name == _name(2):
            raise OSError(errno.EIO, "Input/output error")
        return real(root, space, name, *rest)

    monkeypatch.setattr(disk_store, where, failing)
    try:
        pending = store.start_read([_key(index) for index in (1, 2, 3)], SIZE)
        pending.wait(30)
        found = [None if (data := value.read()) is None else bytes(data) for value in pending.values()]
        # found by a read: the run ends at the bad file; read by a load: that block alone is a miss
        assert found == ([_value(1)] if where == "_open_block" else [_value(1), None, _value(3)])
        assert store.counters.errors == 0 and store.counters.up and store.available()
        assert store.counters.invalid_blocks == 1
        assert _read(store, [3]) == [_value(3)]  # the tier still reads
        assert wait_for(lambda: not (tmp_path / "kv" / SPACE / _name(2)).exists())
    finally:
        store.close()


@pytest.mark.parametrize("argument, value", [("timeout_s", 0), ("retry_s", -1.0), ("max_pending", 0),
                                             ("max_bytes", 0), ("write_bytes_per_s", True),
                                             ("timeout_s", float("nan"))])
def test_a_bad_argument_is_refused_before_the_folder_is_made_or_locked(tmp_path, argument, value):
    folder = tmp_path / "kv"
    with pytest.raises(ValueError, match=f"DiskBlockStore's {argument} must be .*, got {value!r}"):
        DiskBlockStore(folder, **{argument: value})
    assert not folder.exists()
    folder.mkdir()
    with pytest.raises(ValueError, match=argument):
        DiskBlockStore(folder, **{argument: value})
    DiskBlockStore(folder).close()  # the folder's lock was not left taken
