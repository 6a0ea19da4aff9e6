"""Conversations saved by name beside the disk tier's blocks (llama-server's slot files, kvcache's way).

    saved = SavedPrompts(disk_store.folder)                 # <folder>/slots/, made 0700
    saved.write("support-42", {"namespace": …, "tokens": [...], "cache_salt": None})
    saved.read("support-42")                                # the same dict; None when not saved
    saved.erase("support-42")                               # True when it was there

The keys and values themselves stay in the disk tier, in its block files (`block_codec`: checked
byte for byte when read); a saved conversation's file holds only what finds them again: its token
ids, the cache salt its blocks' hashes start from and the namespace (model, dtype, block layout)
they were written in, as one JSON object. A name is 1 to 128 letters, digits, '.', '_' or '-',
starting with a letter or digit, with no '..': never a path. Files are created 0600 in a folder
made 0700 (whatever the umask), written to an unpredictable temporary name created exclusively and
renamed into place, and reached from the folder's descriptor without following a link: `slots`
that is a link is refused, a saved file that is a link or not a regular file is never read
(only removed). A file larger than MAX_FILE_BYTES is refused before it is read.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from kvcache.tiers.disk_store import write_replacing

FOLDER = "slots"  # inside the disk tier's folder (not a namespace's name: the block index skips it)
SUFFIX = ".json"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_FILE_BYTES = 64 << 20  # a context of millions of token ids, as JSON
MAX_SAVED = 256  # conversations one folder holds at once (each pins its blocks on disk)
_NO_FOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class SavedPromptError(ValueError):
    """A name that is not one, a folder or file refused (a link, too large, not a saved
    conversation)."""


def check_name(name: object) -> str:
    """`name` when it may name a saved conversation (see the module docstring); SavedPromptError
    saying what a name is otherwise."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        shown = repr(name) if not isinstance(name, str) or len(name) <= 60 else repr(name[:57] + "...")
        raise SavedPromptError(f"a saved conversation's id is 1 to 128 letters, digits, '.', '_' or '-', "
                               f"starting with a letter or digit, with no '..' (never a path), got {shown}")
    return name


class SavedPrompts:
    """The saved conversations under `<folder>/slots/` (see the module docstring)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder) / FOLDER

    @contextlib.contextmanager
    def _slots(self) -> Iterator[int]:
        """A descriptor of the slots folder, made 0700 when absent; SavedPromptError when it is a
        link or not a folder (never followed)."""
        root = os.open(self.folder.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                os.mkdir(FOLDER, 0o700, dir_fd=root)
                created = True
            except FileExistsError:
                created = False
            try:
                slots = os.open(FOLDER, os.O_RDONLY | os.O_DIRECTORY | _NO_FOLLOW, dir_fd=root)
            except OSError as error:
                if error.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise SavedPromptError(f"{self.folder} is a symbolic link or not a folder: refused, "
                                           "never followed (remove it)") from None
                raise
        finally:
            os.close(root)
        try:
            if created:
                os.fchmod(slots, 0o700)
            yield slots
        finally:
            os.close(slots)

    def names(self) -> list[str]:
        """The names saved now (regular files only), sorted."""
        with self._slots() as slots, os.scandir(slots) as entries:
            found = [entry.name.removesuffix(SUFFIX) for entry in entries
                     if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False)]
        return sorted(name for name in found if NAME.fullmatch(name) and ".." not in name)

    def write(self, name: str, saved: dict) -> int:
        """Save `saved` (a JSON object) as `name`, replacing what was saved so; the bytes written."""
        data = json.dumps(saved, separators=(",", ":")).encode()
        file = check_name(name) + SUFFIX
        with self._slots() as slots:
            write_replacing(slots, file, data)  # (a link there: replaced, never followed)
        return len(data)

    def read(self, name: str) -> dict | None:
        """What was saved as `name`; None when nothing was. SavedPromptError for a file that is a
        link, not a regular file, larger than MAX_FILE_BYTES or not a JSON object."""
        file = check_name(name) + SUFFIX
        with self._slots() as slots:
            try:
                descriptor = os.open(file, os.O_RDONLY | os.O_NONBLOCK | _NO_FOLLOW, dir_fd=slots)
            except FileNotFoundError:
                return None
            except OSError as error:
                if error.errno == errno.ELOOP:
                    raise SavedPromptError(f"the saved conversation {name!r} is a symbolic link: never "
                                           "followed") from None
                raise
        with open(descriptor, "rb") as handle:
            info = os.fstat(descriptor)
            if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_FILE_BYTES:
                raise SavedPromptError(f"the saved conversation {name!r} is not a regular file of at most "
                                       f"{MAX_FILE_BYTES} bytes")
            data = handle.read(MAX_FILE_BYTES + 1)
        try:
            saved = json.loads(data)
        except (ValueError, RecursionError):
            saved = None
        if not isinstance(saved, dict) or len(data) > MAX_FILE_BYTES:
            raise SavedPromptError(f"the saved conversation {name!r} is not a JSON object: not one kvcache "
                                   "wrote")
        return saved

    def erase(self, name: str) -> bool:
        """Delete what was saved as `name` (a link there is removed, never followed); whether it
        was there."""
        file = check_name(name) + SUFFIX
        with self._slots() as slots:
            try:
                os.unlink(file, dir_fd=slots)
            except FileNotFoundError:
                return False
        return True
