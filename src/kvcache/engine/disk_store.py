"""A tier of KV blocks in a folder on disk, below the pool and above Redis: a prefix cache that
survives a restart.

One file per block, `<folder>/<namespace>/<digest>.kvb`, holding the block's value exactly as
`block_codec` encodes it (header with the model's namespace, digest and checksum, then the raw
keys and values), so a block is verified, byte for byte, when it is read, and never serves
another model. Files are written to a temporary name and renamed into place, so a process killed
mid-write leaves whole blocks or none (temporary files left behind are removed at the next start;
the data is not fsync'ed: a power cut may lose recent blocks, which then fail their check).

At start the folder is indexed from its file names and sizes alone (no payload is read), oldest
first by modification time. A read, on the reader thread when a request is queued, finds the
prompt's run of blocks in the index and asks the kernel to read their files ahead; each block's
bytes are read when a step loads it, into a buffer reused block after block, then checked and
copied into the pool (reading a long prompt's blocks into fresh memory took longer than all the
rest of its load, since every new page costs a fault). The folder holds at most `max_bytes`, the
least recently used blocks evicted first (a read refreshes a block). One process at a time: the
folder is locked (an advisory lock on `<folder>/.lock`), and a second store on it is refused by
name.
"""

from __future__ import annotations

import fcntl
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from kvcache.engine.block_store import BlockStore

_KEY = re.compile(r"kvcache:([0-9a-f]{32}):([0-9a-f]{32})")
SUFFIX = ".kvb"


def _read_file(path: Path, target) -> int | None:
    """Read `path` into `target` (a writable buffer of the block's size): the bytes read, one
    more than the target holds when the file is longer, None when it is gone."""
    try:
        with open(path, "rb", buffering=0) as handle:
            read = 0
            while read < len(target) and (count := handle.readinto(target[read:])):
                read += count
            return read + len(handle.read(1))
    except FileNotFoundError:
        return None


class DiskBlock:
    """A block found on disk by a read, its bytes read when a step loads it (`bytes_of`)."""

    def __init__(self, store: DiskBlockStore, key: str, path: Path, size: int) -> None:
        self.store, self.key, self.path, self.size = store, key, path, size

    def __len__(self) -> int:
        return self.size

    def read(self) -> memoryview | None:
        """The block's bytes (see `DiskBlockStore.read_block`), None when the file went bad."""
        return self.store.read_block(self)


class DiskBlockStore(BlockStore):
    """Blocks as files under `folder` (see the module docstring).

    Args:
        folder: made if absent; locked while this store is open.
        max_bytes: the most the blocks may take on disk; past it the least recently used go.
        timeout_s: the most a read may take to count. retry_s: how long an error (a full or
            unwritable disk) keeps the tier out of use. max_pending: blocks queued for writing.
        write_bytes_per_s: the most the writer thread writes a second.
    """

    kind = "disk"

    def __init__(self, folder: str | Path, *, max_bytes: int = 8 << 30, timeout_s: float = 2.0,
                 retry_s: float = 30.0, max_pending: int = 512, write_bytes_per_s: int = 256 << 20) -> None:
        if max_bytes < 1 or write_bytes_per_s < 1:
            raise ValueError(f"max_bytes and write_bytes_per_s must be >= 1, got {max_bytes} and "
                             f"{write_bytes_per_s}")
        self.write_bytes_per_s = write_bytes_per_s
        self._write_clock = 0.0  # when the bytes written so far may all have been written, at the rate
        self.folder, self.max_bytes = Path(folder).expanduser(), max_bytes
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock_file = open(self.folder / ".lock", "a+b")  # noqa: SIM115 (held while open)
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            raise ValueError(f"another kvcache process uses the KV disk folder {self.folder}") from None
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._index_lock = threading.Lock()
        self._pinned: set[str] = set()  # keys evicted last (`pin`)
        self._buffers = threading.local()  # one block's bytes per thread, reused by each read_block
        self.bytes = 0
        self._scan()
        super().__init__(str(self.folder), (OSError,), timeout_s=timeout_s, retry_s=retry_s,
                         max_pending=max_pending)

    def _scan(self) -> None:
        """Index the blocks on disk by name and size, oldest first; remove temporary files a
        killed writer left."""
        found = []
        for space in self.folder.iterdir():
            if not (space.is_dir() and re.fullmatch(r"[0-9a-f]{32}", space.name)):
                continue
            for entry in os.scandir(space):
                digest = entry.name.removesuffix(SUFFIX)
                if entry.name.endswith(".tmp"):
                    Path(entry.path).unlink(missing_ok=True)
                elif entry.name.endswith(SUFFIX) and re.fullmatch(r"[0-9a-f]{32}", digest):
                    stat = entry.stat()
                    found.append((stat.st_mtime, f"kvcache:{space.name}:{digest}", stat.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self.bytes += size
        self._evict()

    def path(self, key: str) -> Path | None:
        """Where the block of `key` (`block_codec.block_key`) lives; None for a key of another form."""
        match = _KEY.fullmatch(key)
        return None if match is None else self.folder / match.group(1) / (match.group(2) + SUFFIX)

    def blocks(self) -> int:
        """Blocks indexed now."""
        with self._index_lock:
            return len(self._index)

    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        # the run's files are found and the kernel asked to read them ahead; their bytes are read
        # when a step loads them (`DiskBlock.read`), into memory this process already holds: a
        # long prompt's bytes read into fresh memory here took longer than the rest of its load
        blocks = []
        for key in keys:
            with self._index_lock:
                size = self._index.get(key)
            path = self.path(key)
            if size != value_bytes or path is None:
                if size is not None:  # another size (truncated, or not a block): never read
                    self.counters.invalid_blocks += 1
                    self.discard(key)
                break
            try:
                descriptor = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # gone since it was indexed
                self.discard(key)
                break
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(descriptor)
            with self._index_lock:
                if key in self._index:
                    self._index.move_to_end(key)
            try:
                os.utime(path)  # most recently used, across restarts too
            except FileNotFoundError:  # evicted or discarded since it was opened
                self.discard(key)
                break
            blocks.append(DiskBlock(self, key, path, value_bytes))
        self.counters.read_round_trips += 1
        return blocks

    def read_block(self, block: DiskBlock) -> memoryview | None:
        """The bytes of `block`, read into a buffer of the calling thread's (valid until its next
        call: the engine's step decodes a block and copies it into the pool before the next);
        None when the file is gone or not its size (then forgotten and deleted)."""
        buffer = getattr(self._buffers, "block", None)
        if buffer is None or len(buffer) != block.size:
            buffer = self._buffers.block = bytearray(block.size)
        target = memoryview(buffer)
        try:
            read = _read_file(block.path, target)
        except OSError as error:  # (EIO, a stale handle): the tier, not the request, failed
            self.failed(error, "reading a block")
            read = None
        if read != block.size:
            self.discard(block.key)
            return None
        return target

    def _write(self, batch: list[tuple[str, bytes]]) -> int:
        try:
            return self._write_files(batch)
        finally:
            self._evict()  # (a batch cut short by a full disk still leaves the folder in its size)

    def _write_files(self, batch: list[tuple[str, bytes]]) -> int:
        written = 0
        for key, value in batch:
            path = self.path(key)
            if path is None:
                continue
            path.parent.mkdir(exist_ok=True)
            temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            try:
                temporary.write_bytes(value)
                os.replace(temporary, path)  # whole or not at all
            finally:
                temporary.unlink(missing_ok=True)
            with self._index_lock:
                self.bytes += len(value) - self._index.pop(key, 0)
                self._index[key] = len(value)
            written += len(value)
            self._pace(len(value))
        return written

    def _pace(self, size: int) -> None:
        """Sleep (on the writer thread) so writes stay within write_bytes_per_s: a long prompt's
        blocks do not take the disk's whole bandwidth from reads."""
        now = time.monotonic()
        self._write_clock = max(self._write_clock, now) + size / self.write_bytes_per_s
        if self._write_clock - now > 0.01:
            time.sleep(self._write_clock - now)

    def pin(self, keys: list[str]) -> None:
        """Evict the blocks of `keys` only after every other block (a pinned prefix's)."""
        with self._index_lock:
            self._pinned.update(keys)

    def _evict(self) -> None:
        """Remove the least recently used blocks until the folder is within max_bytes, pinned
        ones last."""
        while True:
            with self._index_lock:
                if self.bytes <= self.max_bytes or not self._index:
                    return
                key = next((k for k in self._index if k not in self._pinned), next(iter(self._index)))
                size = self._index.pop(key)
                self.bytes -= size
            path = self.path(key)
            if path is not None:
                path.unlink(missing_ok=True)

    def discard(self, key: str) -> None:
        """Forget and delete the block of `key` (it failed its check, or is truncated)."""
        with self._index_lock:
            self.bytes -= self._index.pop(key, 0)
        path = self.path(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop the threads (queued blocks are dropped) and unlock the folder once the writer has
        ended (a batch it is writing is finished first)."""
        super().close()
        self._writer.join(timeout=30)
        self._lock_file.close()
