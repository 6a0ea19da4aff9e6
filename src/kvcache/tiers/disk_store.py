"""A tier of KV blocks in a folder on disk, below the pool and above Redis: a prefix cache that
survives a restart.

One file per block, `<folder>/<namespace>/<digest>.kvb`, holding the block's value exactly as
`block_codec` encodes it (header with the model's namespace, digest and checksum, then the raw
keys and values), so a block is verified, byte for byte, when it is read, and never serves
another model. Blocks are plaintext: the keys and values of a prompt, from which the prompt can
be recovered with the model; the folder is made 0700 and each file 0600 (whatever the umask),
and no encryption at rest is offered. Files are written to an unpredictable temporary name,
created exclusively, and renamed into place, so a process killed mid-write leaves whole blocks or
none (temporary files left behind are removed at the next start; the data is not fsync'ed: a
power cut may lose recent blocks, which then fail their check).

The folder may hold what a stranger planted, and nothing outside it is ever touched: every file is
reached from the folder's open descriptor, one component at a time, without following a link
(a namespace folder that is a link is never descended, a block that is a link is never read,
refreshed or written through: only the link itself is removed), and a block is opened without
waiting (a FIFO is refused, not waited on). `<folder>/.lock` that is a link is refused.

At start the folder is indexed from its entries' names and `lstat` alone (no payload is read),
oldest first by modification time, one in the future taken as now. Only regular files are indexed (a
folder or FIFO named like a block is skipped); each counts the bytes it takes on disk (its size, or
fewer when the file is sparse), and one larger than the whole folder may hold is deleted: it can
never be a block this store keeps, and must not push real blocks out. A read, on the reader thread
when a request is queued, finds the prompt's run of blocks in the index, checks each file's size and
asks the kernel to read it ahead; each block's bytes are read when a step loads it, on a reader
thread of the store's, into a buffer reused block after block, then checked and copied into the
pool. That read is waited for on the step: a load's blocks share one deadline, `timeout_s` from its
start (`TierConnector.load`), and a read not done by then is a miss and pauses reads for `retry_s`, so a
stalled disk holds a step `timeout_s` at most. A block that fails its check is deleted; one that
cannot be deleted is logged once and never read or written again by this store. The folder holds at
most `max_bytes`, the least recently used blocks evicted first (a read refreshes a block). A failed
write (a full disk) stops writes for `retry_s`, not reads, and on a full disk the least recently
used blocks worth the failed batch are evicted. One process at a time: the folder is locked (an
advisory lock on `<folder>/.lock`), and a second store on it is refused by name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import stat
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

from kvcache.tiers.block_store import BlockStore, DaemonExecutor

log = logging.getLogger("kvcache.store")
_KEY = re.compile(r"kvcache:([0-9a-f]{32}):([0-9a-f]{32})")
_HEX = re.compile(r"[0-9a-f]{32}")
SUFFIX = ".kvb"
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_LINK = (errno.ELOOP, errno.ENOTDIR)  # what opening a link with O_NOFOLLOW (or through one) raises
_FULL = (errno.ENOSPC, errno.EDQUOT)


class _Closed(OSError):
    """The store was closed under a call (not a file's error)."""


def _place(key: str) -> tuple[str, str] | None:
    """(namespace folder, file name) of the block of `key`; None for a key of another form."""
    match = _KEY.fullmatch(key)
    return None if match is None else (match.group(1), match.group(2) + SUFFIX)


@contextlib.contextmanager
def _space(root: int, space: str) -> Iterator[int]:
    """A descriptor of the namespace folder `space` under the folder open as `root`; OSError
    (ELOOP, ENOTDIR) when it is a link or not a folder: never followed."""
    descriptor = os.open(space, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=root)
    try:
        yield descriptor
    finally:
        os.close(descriptor)


def _open_block(root: int, space: str, name: str) -> int | None:
    """A read-only descriptor of the block file `name` of namespace `space`, never opened through a
    link nor waiting on a FIFO: -1 when it is not a regular file (a link, a FIFO), None when it is
    gone. The caller closes it."""
    try:
        with _space(root, space) as folder:
            descriptor = os.open(name, os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW, dir_fd=folder)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno in _LINK:
            return -1
        raise
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        return -1
    return descriptor


def _read_file(root: int, space: str, name: str, target) -> int | None:
    """Read the block file `name` of namespace `space` into `target` (a writable buffer of the
    block's size): the bytes read, one more than the target holds when the file is longer, -1 when
    it is not a regular file (a link, a FIFO), None when it is gone."""
    descriptor = _open_block(root, space, name)
    if descriptor is None or descriptor < 0:
        return descriptor
    with open(descriptor, "rb", buffering=0) as handle:
        read = 0
        while read < len(target) and (count := handle.readinto(target[read:])):
            read += count
        return read + len(handle.read(1))


def _write_all(descriptor: int, data: bytes) -> None:
    """Write all of `data` to `descriptor`."""
    view = memoryview(data)
    while view:
        view = view[os.write(descriptor, view) :]


def write_replacing(folder: int, name: str, data: bytes) -> None:
    """Write `data` as file `name` of the folder open as `folder`: to a temporary name with 16
    random hex digits and `.tmp`, created exclusively (0600) and never through a link, then
    renamed into place (whole or not at all; a link at the name is replaced, never followed).
    On failure the temporary file is removed where it can be and the error raised."""
    temporary = f"{name}.{secrets.token_hex(8)}.tmp"
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NO_FOLLOW, 0o600, dir_fd=folder)
    try:
        try:
            os.fchmod(descriptor, 0o600)
            _write_all(descriptor, data)
        finally:
            os.close(descriptor)
        os.replace(temporary, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary, dir_fd=folder)
        raise


def _open_folder(folder: Path) -> int:
    """A descriptor of `folder`, made 0700 (whatever the umask) when absent."""
    try:
        folder.mkdir(parents=True, mode=0o700)
        created = True
    except FileExistsError:
        created = False
    root = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    if created:
        os.fchmod(root, 0o700)
    return root


def _lock(root: int, folder: Path) -> int:
    """`<folder>/.lock` opened (0600, never through a link) and locked; ValueError naming the folder
    when it is a link, not a regular file, or locked by another process."""
    where = f"the KV disk folder's lock file {folder / '.lock'}"
    try:
        descriptor = os.open(".lock", os.O_RDWR | os.O_CREAT | os.O_NONBLOCK | _NO_FOLLOW, 0o600, dir_fd=root)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ValueError(f"{where} is a symbolic link: refused, never followed (--kv-disk {folder}: "
                             "remove the link, or give another folder)") from None
        raise OSError(error.errno, f"cannot open {where} (--kv-disk {folder}): {error.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise ValueError(f"{where} is not a regular file (--kv-disk {folder}: remove it)")
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"another kvcache process uses the KV disk folder {folder}") from None
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def _check_arguments(**given) -> None:
    """ValueError naming the first of DiskBlockStore's numbers out of its range: max_bytes,
    write_bytes_per_s and max_pending ints >= 1, timeout_s > 0, retry_s >= 0."""
    for name, value in given.items():
        whole = name in ("max_bytes", "write_bytes_per_s", "max_pending")
        kinds = int if whole else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not (
            value >= 1 if whole else value > 0 if name == "timeout_s" else value >= 0
        ):
            expected = "an int >= 1" if whole else "a number > 0" if name == "timeout_s" else "a number >= 0"
            raise ValueError(f"DiskBlockStore's {name} must be {expected}, got {value!r}")


class DiskBlock:
    """A block found on disk by a read, its bytes read when a step loads it (`read`)."""

    def __init__(self, store: DiskBlockStore, key: str, space: str, name: str, size: int) -> None:
        self.store, self.key, self.space, self.name, self.size = store, key, space, name, size

    def __len__(self) -> int:
        return self.size

    def read(self, deadline: float | None = None) -> memoryview | None:
        """The block's bytes (see `DiskBlockStore.read_block`), None when the file went bad or did
        not answer in time (by `deadline`, a `time.monotonic()` one load shares, when given)."""
        return self.store.read_block(self, deadline)


class DiskBlockStore(BlockStore):
    """Blocks as files under `folder` (see the module docstring).

    Args:
        folder: made (0700) if absent; locked while this store is open. ValueError when empty.
        max_bytes: the most the blocks may take on disk; past it the least recently used go.
        timeout_s: the most a read may take to count. retry_s: how long an error keeps the tier
            (a failed write: its writes) out of use. max_pending: blocks queued for writing.
        write_bytes_per_s: the most the writer thread writes a second.
    """

    kind = "disk"
    medium = "DISK"

    def __init__(self, folder: str | Path, *, max_bytes: int = 8 << 30, timeout_s: float = 2.0,
                 retry_s: float = 30.0, max_pending: int = 512, write_bytes_per_s: int = 256 << 20) -> None:
        if os.fspath(folder) == "":
            raise ValueError("the KV disk folder (--kv-disk DIR) must name a folder, got an empty path")
        _check_arguments(max_bytes=max_bytes, write_bytes_per_s=write_bytes_per_s, max_pending=max_pending,
                         timeout_s=timeout_s, retry_s=retry_s)  # before the folder is made, locked, read
        self.write_bytes_per_s = write_bytes_per_s
        self._write_clock = 0.0  # when the bytes written so far may all have been written, at the rate
        self.folder, self.max_bytes = Path(folder).expanduser(), max_bytes
        self._root = _open_folder(self.folder)  # every file is reached from here, no link followed
        self._root_users, self._closing = 0, False  # threads using it; closed when the last is done
        self._root_lock = threading.Lock()
        try:
            self._lock_file = _lock(self._root, self.folder)
        except BaseException:
            os.close(self._root)
            raise
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> bytes, least recently used first
        self._index_lock = threading.Lock()
        self._pinned: Counter[str] = Counter()  # keys evicted last, with how many pins hold each (`pin`)
        self._bad: set[str] = set()  # keys whose file failed and could not be deleted: never used again
        self._warned_undeletable = self._warned_unreadable = False
        self._failed_writes = 0  # (`failure_count`)
        self._buffers = threading.local()  # one block's bytes per calling thread, reused by each read_block
        self.bytes = 0
        try:
            self._scan()
            super().__init__(str(self.folder), (OSError,), timeout_s=timeout_s, retry_s=retry_s,
                             max_pending=max_pending)
        except BaseException:
            os.close(self._lock_file)
            os.close(self._root)
            raise
        self._block_reader = DaemonExecutor("kvcache-disk-block-reader")  # a step's reads, with a deadline

    # ---- the folder ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _folder(self) -> Iterator[int]:
        """The folder's descriptor, kept open while a thread uses it (a read stuck past close())."""
        with self._root_lock:
            if self._closing:
                raise _Closed(errno.EBADF, f"the KV disk store on {self.folder} is closed")
            self._root_users += 1
        try:
            yield self._root
        finally:
            with self._root_lock:
                self._root_users -= 1
                if self._closing and not self._root_users:
                    os.close(self._root)

    @contextlib.contextmanager
    def _in_space(self, space: str) -> Iterator[int]:
        """A descriptor of the namespace folder `space` (never a link: OSError then)."""
        with self._folder() as root, _space(root, space) as folder:
            yield folder

    def _read_into(self, block: DiskBlock, target) -> int | None:
        with self._folder() as root:
            return _read_file(root, block.space, block.name, target)

    # ---- the index ---------------------------------------------------------------------------------
    def _scan(self) -> None:
        """Index the blocks on disk by name and `lstat`, oldest first (see the module docstring);
        remove temporary files a killed writer left."""
        now = time.time()
        with os.scandir(self._root) as entries:
            spaces = [entry.name for entry in entries
                      if _HEX.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False)]
        found = []
        for space in spaces:
            try:
                with _space(self._root, space) as folder:
                    found += self._scan_space(folder, space, now)
            except OSError as error:  # swapped for a link or removed since it was listed: skipped
                log.warning("KV disk folder %s: namespace %s skipped (%s)", self.folder, space, error)
        for _, key, size in sorted(found):
            self._index[key] = size
            self.bytes += size
        self._evict()

    def _scan_space(self, folder: int, space: str, now: float) -> list[tuple[float, str, int]]:
        found = []
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:  # removed since it was listed
                    continue
                digest = entry.name.removesuffix(SUFFIX)
                if entry.name.endswith(".tmp") and not stat.S_ISDIR(info.st_mode):
                    self._remove(folder, entry.name)  # a killed write's (a link is removed, never followed)
                elif not (entry.name.endswith(SUFFIX) and _HEX.fullmatch(digest)):
                    continue
                elif stat.S_ISDIR(info.st_mode):  # a block could never be renamed over it
                    self._bad.add(f"kvcache:{space}:{digest}")
                elif not stat.S_ISREG(info.st_mode):  # a link, a FIFO: never read (a write replaces it)
                    continue
                elif info.st_size > self.max_bytes:  # can never be a block this store keeps
                    self._remove(folder, entry.name)
                else:
                    held = min(info.st_size, info.st_blocks * 512)  # a sparse file takes what it holds
                    found.append((min(info.st_mtime, now), f"kvcache:{space}:{digest}", held))
        return found

    def path(self, key: str) -> Path | None:
        """Where the block of `key` (`block_codec.block_key`) lives; None for a key of another form."""
        place = _place(key)
        return None if place is None else self.folder / place[0] / place[1]

    def blocks(self) -> int:
        """Blocks indexed now."""
        with self._index_lock:
            return len(self._index)

    # ---- reads -------------------------------------------------------------------------------------
    def _read_run(self, keys: list[str], value_bytes: int) -> list:
        # the run's files are found and the kernel asked to read them ahead; their bytes are read
        # when a step loads them (`DiskBlock.read`), into memory this process already holds: a
        # long prompt's bytes read into fresh memory here took longer than the rest of its load
        blocks = []
        for key in keys:
            with self._index_lock:
                held = key in self._index and key not in self._bad
            place = _place(key)
            if not held or place is None:
                break
            try:
                size = self._open_ahead(*place)
            except _Closed:
                raise
            except OSError as error:  # (EACCES, EIO on this one file): a miss, the tier stays up
                self._unreadable(key, error)
                break
            if size != value_bytes:
                if size is not None:  # another size (truncated, or not a block): never read
                    self.counters.invalid_blocks += 1
                self.discard(key)  # (None: gone since it was indexed)
                break
            with self._index_lock:
                if key in self._index:
                    self._index.move_to_end(key)
            blocks.append(DiskBlock(self, key, *place, value_bytes))
        self.counters.read_round_trips += 1
        return blocks

    def _open_ahead(self, space: str, name: str) -> int | None:
        """Open a block's file (never a link, never waiting on a FIFO), ask the kernel to read it
        ahead and mark it used now (across restarts too): its size, -1 when it is not a regular
        file, None when it is gone."""
        with self._folder() as root:
            descriptor = _open_block(root, space, name)
        if descriptor is None or descriptor < 0:
            return descriptor
        try:
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
            with contextlib.suppress(PermissionError):  # (a file of another owner: served, not refreshed)
                os.utime(descriptor)  # the file opened, never a link's target
            return os.fstat(descriptor).st_size
        finally:
            os.close(descriptor)

    def read_block(self, block: DiskBlock, deadline: float | None = None) -> memoryview | None:
        """The bytes of `block`, read on the store's block reader thread into a buffer of the
        calling thread's (valid until its next call: the engine's step decodes a block and copies
        it into the pool before the next); None when reads are paused, `deadline` (a
        `time.monotonic()` shared by a load's blocks, so a step waits timeout_s at most for all of
        them) has passed, the file did not answer within timeout_s or by the deadline (then reads
        pause for retry_s), or it is gone or not its size (then forgotten and deleted)."""
        wait = self.timeout_s if deadline is None else min(self.timeout_s, deadline - time.monotonic())
        if not self.available() or wait <= 0:
            return None
        buffer = getattr(self._buffers, "block", None)
        if buffer is None or len(buffer) != block.size:
            buffer = self._buffers.block = bytearray(block.size)
        target = memoryview(buffer)
        future = self._block_reader.submit(lambda: self._read_into(block, target))
        try:
            read = future.result(timeout=wait)
        except FutureTimeout:  # the file does not answer: a miss, and the tier paused
            future.cancel()
            self.failed(TimeoutError(f"a block not read within {wait:.3g} s"), "reading a block")
            return None
        except _Closed:
            return None
        except OSError as error:  # (EACCES, EIO, EISDIR on this one file): a miss, the tier stays up
            self._unreadable(block.key, error)
            return None
        if read != block.size:
            if read is not None:
                self.counters.invalid_blocks += 1
            self.discard(block.key)
            return None
        return target

    def _unreadable(self, key: str, error: OSError) -> None:
        """The file of `key` failed to open or read (EACCES, EIO, …): that block is a miss, counted
        invalid, forgotten and deleted (remembered as bad when it cannot be), logged once; the
        tier and its other blocks stay in use."""
        self.counters.invalid_blocks += 1
        with self._index_lock:
            warned, self._warned_unreadable = self._warned_unreadable, True
        if not warned:
            log.warning("KV disk folder %s: the block file of %s cannot be read (%s: %s); it is a miss and "
                        "is deleted, the tier stays in use (further ones are not logged)", self.folder, key,
                        type(error).__name__, error)
        self.discard(key)

    # ---- writes ------------------------------------------------------------------------------------
    def put(self, key: str, make_value) -> bool:
        """As `BlockStore.put`; a block already on disk is not written again (True: the tier holds
        it); one whose file could not be deleted is never written again."""
        with self._index_lock:
            bad, held = key in self._bad, key in self._index
        if bad:
            self.counters.dropped_blocks += 1
            return False
        return held or super().put(key, make_value)

    def _write_batch(self, batch: list) -> None:
        try:
            super()._write_batch(batch)  # (its blocks told stored before any of them is evicted)
        finally:
            self._evict()  # (a batch cut short by a full disk still leaves the folder in its size)

    def _write(self, batch: list[tuple[str, bytes]]) -> int:
        return self._write_files(batch)

    def _write_files(self, batch: list[tuple[str, bytes]]) -> int:
        written = 0
        for key, value in batch:
            place = _place(key)
            with self._index_lock:  # (put before its old file turned out undeletable: never written over)
                bad = key in self._bad
            if place is None or bad:
                continue
            self._write_file(*place, value)
            with self._index_lock:
                self.bytes += len(value) - self._index.pop(key, 0)
                self._index[key] = len(value)
            written += len(value)
            self._pace(len(value))
        return written

    def _write_file(self, space: str, name: str, value: bytes) -> None:
        """Write `value` as block file `name` of namespace `space` (`write_replacing`)."""
        with self._folder() as root:
            try:
                os.mkdir(space, 0o700, dir_fd=root)
                created = True
            except FileExistsError:
                created = False
        with self._in_space(space) as folder:
            if created:
                os.fchmod(folder, 0o700)  # whatever the umask
            write_replacing(folder, name, value)

    def failure_count(self) -> int:
        """Failed writes since start: only those lose blocks the tier took (a read that timed out
        or a bad file loses none, so `TierConnector` need not offer every block again after one)."""
        return self._failed_writes

    def failed_writing(self, error: BaseException, wanted_bytes: int) -> None:
        """A failed write stops writes for retry_s, not reads; a full disk also gives back the
        least recently used blocks worth what did not fit."""
        self._failed_writes += 1
        if isinstance(error, OSError) and error.errno in _FULL:
            with self._index_lock:
                target = max(0, self.bytes - wanted_bytes)
            self._evict(target)
        self.pause_writes(error)

    def _pace(self, size: int) -> None:
        """Sleep (on the writer thread) so writes stay within write_bytes_per_s: a long prompt's
        blocks do not take the disk's whole bandwidth from reads."""
        now = time.monotonic()
        self._write_clock = max(self._write_clock, now) + size / self.write_bytes_per_s
        if self._write_clock - now > 0.01:
            time.sleep(self._write_clock - now)

    # ---- eviction and deletion ---------------------------------------------------------------------
    def listen(self, listener) -> None:
        """As `BlockStore.listen`; the blocks the folder already holds (a restarted replica's) are
        told stored at once."""
        super().listen(listener)
        with self._index_lock:
            held = list(self._index)
        if held:
            listener.tier_stored(self.medium, held)

    def pin(self, keys: list[str]) -> None:
        """Evict the blocks of `keys` only after every other block (a pinned prefix's, a saved
        conversation's); pins are counted, so each `unpin` undoes one."""
        with self._index_lock:
            self._pinned.update(keys)

    def unpin(self, keys: list[str]) -> None:
        """Undo one `pin` of each of `keys`: a block no pin holds any more is evicted as any other."""
        with self._index_lock:
            self._pinned.subtract(keys)
            for key in keys:
                if self._pinned[key] <= 0:
                    del self._pinned[key]

    def holds(self, key: str) -> bool:
        """Whether the block of `key` is on disk now (indexed, and not known bad)."""
        with self._index_lock:
            return key in self._index and key not in self._bad

    def _evict(self, limit: int | None = None) -> None:
        """Remove the least recently used blocks until the folder holds at most `limit` bytes
        (max_bytes when None), pinned ones last."""
        limit = self.max_bytes if limit is None else limit
        while True:
            with self._index_lock:
                if self.bytes <= limit or not self._index:
                    return
                key = next((k for k in self._index if k not in self._pinned), next(iter(self._index)))
                size = self._index.pop(key)
                self.bytes -= size
            self._delete(key)
            self.tell_removed([key])

    def discard(self, key: str) -> None:
        """Forget the block of `key` (it failed its check, or is truncated) and delete its file on
        the block reader thread (a step never waits on the disk); one that cannot be deleted is
        remembered as bad (never read or written again), logged once."""
        with self._index_lock:
            held = key in self._index
            self.bytes -= self._index.pop(key, 0)
        if held:
            self.tell_removed([key])
        with contextlib.suppress(RuntimeError):  # (closed: the file is found again at the next start)
            self._block_reader.submit(lambda: self._delete_discarded(key))

    def _delete_discarded(self, key: str) -> None:
        with self._index_lock:
            if key in self._index:  # written again since it was discarded: the new file stays
                return
        self._delete(key)

    def _delete(self, key: str) -> None:
        place = _place(key)
        if place is None:
            return
        try:
            with self._in_space(place[0]) as folder:
                os.unlink(place[1], dir_fd=folder)  # (a link is removed, never followed)
        except FileNotFoundError:
            return
        except OSError as error:  # (immutable, a sticky folder, EIO, a namespace swapped for a link)
            self._undeletable(key, error)

    def _remove(self, folder: int, name: str) -> None:
        """Delete `name` from the namespace folder open as `folder` (a killed write's temporary
        file, a file too large to be a block), logging once when it cannot be."""
        try:
            os.unlink(name, dir_fd=folder)
        except FileNotFoundError:
            pass
        except OSError as error:
            self._undeletable(name, error)

    def _undeletable(self, what: str, error: OSError) -> None:
        with self._index_lock:
            if _place(what) is not None:
                self._bad.add(what)
            warned, self._warned_undeletable = self._warned_undeletable, True
        if not warned:
            log.warning("KV disk folder %s: %s cannot be deleted (%s: %s); it is never read again by this "
                        "process (further ones are not logged)", self.folder, what, type(error).__name__,
                        error)

    def close(self) -> None:
        """Stop the threads (queued blocks are dropped) and unlock the folder once the writer has
        ended (a batch it is writing is finished first)."""
        super().close()
        self._block_reader.shutdown()
        self._writer.join(timeout=30)
        with self._root_lock:
            if self._closing:
                return
            self._closing = True
            os.close(self._lock_file)
            if not self._root_users:
                os.close(self._root)
