"""What every tier of prefix blocks below the pool shares (Redis, a disk folder): counters, the
up/down state, reads on a reader thread that never block a step, writes through a bounded queue
on a writer thread. A tier says how it reads a run of keys (`_read_run`) and writes a batch
(`_write`); `store_tier.TierConnector` decides what to ask and checks every byte read back.

Any error (down, slow past `timeout_s`, full, unwritable) marks the tier down for `retry_s`
seconds, during which it is not asked at all; the outage is logged once and counted, and the next
call after the pause tries again. A tier whose reads go on when a write fails (a full disk) stops
writes alone for `retry_s` (`failed_writing`, `pause_writes`). Its threads are daemon threads: one
stuck in a call that never returns (a hung disk or socket) never keeps a program from exiting.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("kvcache.store")
MAX_READS = 16  # reads started and not done: past it (a stuck tier) no more are queued
WRITE_BATCH = 64  # blocks written at once


@dataclass
class StoreCounters:
    """What a tier did since start (blocks, bytes, errors)."""

    lookups: int = 0  # requests that asked the tier
    found_blocks: int = 0  # blocks the tier returned to a read
    hit_blocks: int = 0  # blocks read back and used
    invalid_blocks: int = 0  # read back but refused (checksum, layout, size): recomputed
    written_blocks: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    dropped_blocks: int = 0  # not written: queue full, tier down or failing
    errors: int = 0  # failed calls (each outage counts its calls)
    read_round_trips: int = 0
    write_batches: int = 0  # batched writes, one round trip (or one pass over files) each
    outages: int = 0
    up: bool = True


class TierListener(Protocol):
    """Told, on a tier's threads, of the blocks the tier `medium` ("DISK", "REDIS") now holds and
    no longer holds, by key (`block_codec.block_key`): the KV events' tier media
    (`store_tier.TierConnector.tier_stored`)."""

    def tier_stored(self, medium: str, keys: list[str]) -> None:
        """These blocks were written to the tier."""

    def tier_removed(self, medium: str, keys: list[str]) -> None:
        """These blocks were evicted or deleted from the tier."""


class BlockStore:
    """A tier's reader and writer threads and health. name: how logs call it. errors: the
    exceptions that mean the tier failed (anything else is a bug and is raised)."""

    def __init__(self, name: str, errors: tuple, *, timeout_s: float, retry_s: float,
                 max_pending: int) -> None:
        if timeout_s <= 0 or retry_s < 0 or max_pending < 1:
            raise ValueError(f"need timeout_s > 0, retry_s >= 0, max_pending >= 1; got {timeout_s}, "
                             f"{retry_s}, {max_pending}")
        self.name, self.errors = name, errors
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.counters = StoreCounters()
        self._down_until = 0.0  # reads and writes paused until (an outage)
        self._writes_down_until = 0.0  # writes alone paused until (`pause_writes`)
        self._lock = threading.Lock()  # counters and the up/down state
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._drain, name="kvcache-store-writer", daemon=True)
        self._writer.start()
        self._reader = DaemonExecutor("kvcache-store-reader")
        self._reads: list[PendingRead] = []  # started, perhaps not done

    # ---- what a tier implements -------------------------------------------------------------------
    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        """(on the reader thread) the values of the leading run of `keys` held with `value_bytes`
        bytes each (None past the end of the run is allowed)."""
        raise NotImplementedError

    def _write(self, batch: list[tuple[str, bytes]]) -> int:
        """(on the writer thread) store every (key, value); the bytes written."""
        raise NotImplementedError

    def discard(self, key: str) -> None:
        """Forget the block of `key`, which failed its check (a tier that can delete it does)."""

    def pin(self, keys: list[str]) -> None:
        """Evict these blocks last (a tier that evicts by its own rule, as Redis does, ignores it)."""

    def unpin(self, keys: list[str]) -> None:
        """Undo one `pin` of these blocks (pins are counted: a block stays pinned while any holds it)."""

    kind = "store"  # what /metrics calls the tier
    medium = "STORAGE"  # what KV events call the tier (`kvcache.engine.kv_events`)
    listener = None  # told of blocks written and removed (`TierListener`); None: no one

    def listen(self, listener) -> None:
        """Tell `listener` (a `TierListener`) of the blocks this tier writes and removes."""
        self.listener = listener

    def tell_removed(self, keys: list[str]) -> None:
        """The listener's `tier_removed` for `keys` (the tier no longer holds them)."""
        if self.listener is not None and keys:
            self.listener.tier_removed(self.medium, keys)

    def stats(self) -> dict:
        """The counters as a dict, with the tier's `kind` (`Engine.stats()["kv_store"]`)."""
        return {**vars(self.counters), "kind": self.kind}

    def failure_count(self) -> int:
        """Calls that failed since start: after one, blocks the tier took may be lost (a write that
        failed, a store restarted empty), so they are offered to it again."""
        return self.counters.errors

    # ---- health ------------------------------------------------------------------------------------
    def available(self) -> bool:
        """Whether the tier may be asked now (not inside an outage's pause)."""
        return time.monotonic() >= self._down_until

    def failed(self, error: BaseException, doing: str) -> None:
        """Count a failed call and pause the tier for retry_s (logged once per outage)."""
        with self._lock:
            self.counters.errors += 1
            self._down_until = time.monotonic() + self.retry_s
            if self.counters.up:
                self.counters.up = False
                self.counters.outages += 1
                log.warning("KV store %s unavailable while %s (%s: %s); serving without it, retrying "
                            "every %.1f s", self.name, doing, type(error).__name__, error, self.retry_s)

    def writable(self) -> bool:
        """Whether blocks may be queued for writing now (neither the tier nor its writes paused)."""
        return self.available() and time.monotonic() >= self._writes_down_until

    def failed_writing(self, error: BaseException, wanted_bytes: int) -> None:
        """A write of `wanted_bytes` failed. Here the tier is taken as down (`failed`): a store that
        cannot take a write is unreachable; a tier whose reads go on (a full disk) overrides it."""
        self.failed(error, "writing blocks")

    def pause_writes(self, error: BaseException) -> None:
        """Count a failed write and queue no writes for retry_s, reads going on (logged once per
        outage)."""
        with self._lock:
            self.counters.errors += 1
            self._writes_down_until = time.monotonic() + self.retry_s
            if self.counters.up:
                self.counters.up = False
                self.counters.outages += 1
                log.warning("KV store %s unavailable for writes (%s: %s); reading the blocks it holds, "
                            "writing again in %.1f s", self.name, type(error).__name__, error, self.retry_s)

    def worked(self) -> None:
        """A call answered: the tier is up (logged when it was down), unless its writes are paused."""
        if not self.counters.up and time.monotonic() >= self._writes_down_until:
            with self._lock:
                if not self.counters.up:
                    self.counters.up = True
                    log.warning("KV store %s is back", self.name)

    # ---- reads ------------------------------------------------------------------------------------
    def start_read(self, keys: list[str], value_bytes: int) -> PendingRead | None:
        """Start reading, on the reader thread, the values of the longest run of `keys` from the
        first that the tier holds with `value_bytes` bytes each (a value of another size ends the
        run, counted invalid, unread); the read, or None when the tier may not be asked now
        (down, or MAX_READS reads already waiting behind a slow one)."""
        self._reads = [read for read in self._reads if not read.future.done()]
        if not keys or not self.available() or len(self._reads) >= MAX_READS:
            return None
        started = threading.Event()  # set when the reader thread takes the read up

        def run() -> list:
            started.set()
            return self._read_run(keys, value_bytes)

        read = PendingRead(self, self._reader.submit(run), time.monotonic() + self.timeout_s, started)
        self._reads.append(read)
        self.counters.lookups += 1
        return read

    # ---- writes -----------------------------------------------------------------------------------
    def put(self, key: str, make_value: Callable[[], bytes]) -> bool:
        """Queue one block for writing; `make_value()` builds its bytes on the writer thread.
        False (and the block counted as dropped) when the queue is full or the tier or its writes
        are paused."""
        if not self.writable():
            self.counters.dropped_blocks += 1
            return False
        try:
            self._pending.put_nowait((key, make_value))
        except queue.Full:
            self.counters.dropped_blocks += 1
            return False
        return True

    def _drain(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._pending.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(batch) < WRITE_BATCH:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write_batch(batch)
            except Exception as error:  # noqa: BLE001 (the connection closed under it by close())
                self.counters.dropped_blocks += len(batch)
                if not self._stop.is_set():
                    self.failed_writing(error, 0)
            finally:
                for _ in batch:
                    self._pending.task_done()

    def _write_batch(self, batch: list) -> None:
        if not self.writable():
            self.counters.dropped_blocks += len(batch)
            return
        values = [(key, make_value()) for key, make_value in batch]
        try:
            written = self._write(values)
        except self.errors as error:
            self.counters.dropped_blocks += len(batch)
            self.failed_writing(error, sum(len(value) for _, value in values))
            return
        self.worked()
        self.counters.written_blocks += len(batch)
        self.counters.written_bytes += written
        self.counters.write_batches += 1
        if self.listener is not None:
            self.listener.tier_stored(self.medium, [key for key, _ in values])

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued block was written or dropped (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:  # queued, or taken and not yet written
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the writer (queued blocks are dropped) and the reader."""
        self._stop.set()
        self._writer.join(timeout=2)
        self._reader.shutdown()


class DaemonExecutor:
    """Calls run one at a time on a daemon thread, each answered through a `Future`. Unlike a
    `ThreadPoolExecutor`, whose threads are joined when the interpreter exits, a call stuck for
    good (a read of a file that never answers) does not keep the program from exiting."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, call: Callable) -> Future:
        """Queue `call()`; its future. RuntimeError once shut down."""
        if self._closed:
            raise RuntimeError("cannot run a call on a store that is closed")
        future: Future = Future()
        self._calls.put((call, future))
        return future

    def _run(self) -> None:
        while (item := self._calls.get()) is not None:
            call, future = item
            if not future.set_running_or_notify_cancel():  # cancelled while queued (its caller gave up)
                continue
            try:
                result = call()
            except BaseException as error:  # noqa: BLE001 (handed to whoever waits on the future)
                future.set_exception(error)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Cancel the calls not yet started and end the thread once it is free (one running goes on)."""
        self._closed = True
        while True:
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[1].cancel()
        self._calls.put(None)


def block_bytes(value):
    """The bytes of a value a read returned: the value itself, or what a tier that reads a
    block's bytes only when it is loaded (`disk_store.DiskBlock`) reads then (None: gone bad)."""
    return value if isinstance(value, bytes | bytearray | memoryview) else value.read()


class PendingRead:
    """A read started by `BlockStore.start_read`: `ready()` once answered or past its deadline;
    then `values()`."""

    def __init__(self, store: BlockStore, future: Future, deadline: float, started: threading.Event) -> None:
        self.store, self.future, self.deadline, self.started = store, future, deadline, started
        self._values: list[bytes] | None = None
        self._settled = False

    def ready(self) -> bool:
        """Whether the answer came, or the deadline passed (then it counts as no answer)."""
        return self.future.done() or time.monotonic() >= self.deadline

    def wait(self, timeout_s: float) -> None:
        """Block until ready, or `timeout_s` at most."""
        with contextlib.suppress(FutureTimeout, Exception):
            self.future.result(timeout=max(0.0, min(timeout_s, self.deadline - time.monotonic())))

    def values(self) -> list[bytes] | None:
        """(once ready) the run's values, [] when the tier holds none; None when it did not
        answer by the deadline or failed (the tier then counts as down for its retry_s)."""
        if not self._settled:
            self._settled = True
            self._values = self._settle()
        return self._values

    def _settle(self) -> list[bytes] | None:
        store = self.store
        if not self.future.done():  # past the deadline: a read taken up and not answered is the
            if self.started.is_set():  # tier's failure; one still queued behind another is not
                store.failed(TimeoutError(f"no answer within {store.timeout_s} s"), "reading blocks")
            return None
        error = self.future.exception()
        if error is not None:
            if not isinstance(error, store.errors):
                raise error
            store.failed(error, "reading blocks")
            return None
        store.worked()
        found: list = []
        for value in self.future.result():  # a block gone between the two looks ends the run
            if value is None:
                break
            found.append(value)
            store.counters.read_bytes += len(value)
        store.counters.found_blocks += len(found)
        return found
