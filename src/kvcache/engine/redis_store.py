"""A second tier of KV blocks in Redis (or a server that speaks its protocol: Valkey, …), shared by
every replica that points at it.

Reads are bounded as a whole and never block a step: one pipelined round trip asks the size of
each of a prompt's block keys (STRLEN: 0 when absent, so a value of the wrong size is never read),
then MGETs of up to READ_BATCH_BYTES each fetch the leading run that holds blocks of the right
size (one MGET for a short prompt; a whole long one in one reply re-grew its buffer to the
prompt's size). They run on a reader thread, started when a request is queued (`start_read`);
its answer counts only if it came within `timeout_s` (a server that trickles its answer a byte
at a time keeps a socket read alive forever): past that the store counts as down.
Writes never block a request: they go to a bounded queue that a background thread drains in
batches (pipelined SET with a TTL); when the queue is full, blocks are dropped and counted.

The store is an optimisation, never a dependency: any error (down, slow past the timeout, full,
out of memory) marks it down for `retry_s` seconds, during which it is not asked at all; the
outage is logged once, counted, and the next call after the pause tries again.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

log = logging.getLogger("kvcache.store")
MAX_READS = 16  # reads started and not done: past it (a stuck store) no more are queued
READ_BATCH_BYTES = 16 << 20  # values fetched by one MGET at most


@dataclass
class StoreCounters:
    """What the store did since start (blocks, bytes, errors)."""

    lookups: int = 0  # requests that asked the store
    hit_blocks: int = 0  # blocks read back and used
    invalid_blocks: int = 0  # read back but refused (checksum, layout, size): recomputed
    written_blocks: int = 0
    written_bytes: int = 0
    read_bytes: int = 0
    dropped_blocks: int = 0  # not written: queue full or store down
    errors: int = 0  # failed calls (each outage counts its calls)
    read_round_trips: int = 0
    write_batches: int = 0  # pipelined writes, one round trip each
    outages: int = 0
    up: bool = True


class RedisBlockStore:
    """Blocks under string keys in one Redis database at `url` (redis://host:port/db).

    Args:
        url: where the server is; its client is the `redis` package (`pip install redis`).
        ttl_s: seconds a written block lives (refreshed by nothing: a block read back is simply
            rewritten when its absence is noticed).
        timeout_s: the socket timeout of every call (connect included), and the most a read
            (both its round trips) may keep the engine waiting.
        retry_s: how long an error keeps the store out of use.
        max_pending: blocks queued for writing before new ones are dropped.
    """

    def __init__(self, url: str, *, ttl_s: int = 3600, timeout_s: float = 0.5, retry_s: float = 2.0,
                 max_pending: int = 512) -> None:
        try:
            import redis
        except ImportError as error:  # pragma: no cover - an install without the extra
            raise ImportError(
                "a Redis KV store needs the redis client: pip install 'kvcache[redis]'"
            ) from error
        if ttl_s < 1 or timeout_s <= 0 or retry_s < 0 or max_pending < 1:
            raise ValueError(
                f"need ttl_s >= 1, timeout_s > 0, retry_s >= 0, max_pending >= 1; got {ttl_s}, "
                f"{timeout_s}, {retry_s}, {max_pending}"
            )
        self.url, self.ttl_s, self.retry_s = url, ttl_s, retry_s
        self._errors = (redis.RedisError, OSError)
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
        )
        self.counters = StoreCounters()
        self._down_until = 0.0
        self._lock = threading.Lock()  # counters and the up/down state
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._drain, name="kvcache-store-writer", daemon=True)
        self._writer.start()
        self.timeout_s = timeout_s
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvcache-store-reader")
        self._reads: list[PendingRead] = []  # started, perhaps not done

    # ---- health ------------------------------------------------------------------------------------
    def available(self) -> bool:
        """Whether the store may be asked now (not inside an outage's pause)."""
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception, doing: str) -> None:
        with self._lock:
            self.counters.errors += 1
            self._down_until = time.monotonic() + self.retry_s
            if self.counters.up:
                self.counters.up = False
                self.counters.outages += 1
                log.warning("KV store %s unavailable while %s (%s: %s); serving without it, retrying "
                            "every %.1f s", self.url, doing, type(error).__name__, error, self.retry_s)

    def _worked(self) -> None:
        if not self.counters.up:
            with self._lock:
                if not self.counters.up:
                    self.counters.up = True
                    log.warning("KV store %s is back", self.url)

    # ---- reads ------------------------------------------------------------------------------------
    def start_read(self, keys: list[str], value_bytes: int) -> PendingRead | None:
        """Start reading, on the reader thread, the values of the longest run of `keys` from the
        first that the store holds with `value_bytes` bytes each (a value of another size ends the
        run, counted invalid, unread); the read, or None when the store may not be asked now
        (down, or MAX_READS reads already waiting behind a slow one)."""
        self._reads = [read for read in self._reads if not read.future.done()]
        if not keys or not self.available() or len(self._reads) >= MAX_READS:
            return None
        read = PendingRead(self, self._reader.submit(self._read_run, keys, value_bytes),
                           time.monotonic() + self.timeout_s)
        self._reads.append(read)
        return read

    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.strlen(key)
        sizes = pipe.execute()
        run = next((index for index, size in enumerate(sizes) if size != value_bytes), len(keys))
        if run < len(keys) and sizes[run]:
            self.counters.invalid_blocks += 1  # present, of another size: never read
        self.counters.read_round_trips += 1
        step = max(1, READ_BATCH_BYTES // max(1, value_bytes))
        values: list = []
        for start in range(0, run, step):  # (one reply of a whole long prompt: its buffer re-grown)
            values += self._client.mget(keys[start : min(run, start + step)])
            self.counters.read_round_trips += 1
        return values

    # ---- writes -----------------------------------------------------------------------------------
    def put(self, key: str, make_value: Callable[[], bytes]) -> bool:
        """Queue one block for writing; `make_value()` builds its bytes on the writer thread.
        False (and the block counted as dropped) when the queue is full or the store is down."""
        if not self.available():
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
            while len(batch) < 64:
                try:
                    batch.append(self._pending.get_nowait())
                except queue.Empty:
                    break
            try:
                self._write(batch)
            except Exception as error:  # noqa: BLE001 (the connection closed under it by close())
                self.counters.dropped_blocks += len(batch)
                if not self._stop.is_set():
                    self._failed(error, "writing blocks")
            finally:
                for _ in batch:
                    self._pending.task_done()

    def _write(self, batch: list) -> None:
        if not self.available():
            self.counters.dropped_blocks += len(batch)
            return
        try:
            pipe = self._client.pipeline(transaction=False)
            written = 0
            for key, make_value in batch:
                value = make_value()
                pipe.set(key, value, ex=self.ttl_s)
                written += len(value)
            pipe.execute()
        except self._errors as error:
            self.counters.dropped_blocks += len(batch)
            self._failed(error, "writing blocks")
            return
        self._worked()
        self.counters.written_blocks += len(batch)
        self.counters.written_bytes += written
        self.counters.write_batches += 1

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every queued block was written or dropped (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while self._pending.unfinished_tasks:  # queued, or taken and not yet written
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the writer (queued blocks are dropped) and close the connection."""
        self._stop.set()
        self._writer.join(timeout=2)
        self._reader.shutdown(wait=False, cancel_futures=True)
        self._client.close()


class PendingRead:
    """A read started by `RedisBlockStore.start_read`: `ready()` once answered or past its
    deadline; then `values()`."""

    def __init__(self, store: RedisBlockStore, future: Future, deadline: float) -> None:
        self.store, self.future, self.deadline = store, future, deadline
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
        """(once ready) the run's values, [] when the store holds none; None when it did not
        answer by the deadline or failed (the store then counts as down for its retry_s)."""
        if not self._settled:
            self._settled = True
            self._values = self._settle()
        return self._values

    def _settle(self) -> list[bytes] | None:
        store = self.store
        if not self.future.done():
            store._failed(TimeoutError(f"no answer within {store.timeout_s} s"), "reading blocks")
            return None
        error = self.future.exception()
        if error is not None:
            if not isinstance(error, store._errors):
                raise error
            store._failed(error, "reading blocks")
            return None
        store._worked()
        found = []
        for value in self.future.result():  # a key evicted between the two calls ends the run
            if value is None:
                break
            found.append(value)
            store.counters.read_bytes += len(value)
        return found
