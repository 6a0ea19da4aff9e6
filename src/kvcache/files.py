"""Reading a stranger's small files (config.json, tokenizer settings, chat templates, shard
indexes): the size is checked before a byte is read, so an 8 GiB "config.json" is refused at
once instead of filling memory; standard library only (the memory planner uses it too)."""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_JSON_BYTES = 16 << 20  # the largest config, tokenizer_config or shard index kvcache reads
MAX_TOKENIZER_BYTES = 256 << 20  # tokenizer.json, read by the tokenizers library


class FileTooLargeError(ValueError):
    """A file larger than what it claims to be could be."""


def check_size(path: str | os.PathLike, limit: int, what: str) -> int:
    """The size of `path` in bytes; raises `FileTooLargeError` past `limit`."""
    size = os.stat(path).st_size
    if size > limit:
        raise FileTooLargeError(
            f"{os.fspath(path)} has {size:,} bytes, past the {limit:,} a {what} may have: not read"
        )
    return size


def read_text(path: str | os.PathLike, what: str, limit: int = MAX_JSON_BYTES) -> str:
    """The UTF-8 text of the regular file `path` (`what` names it in errors: "chat template",
    "--kv-pin"), at most `limit` bytes. Opened without waiting (a FIFO with no writer is refused,
    not waited on), checked on the opened file (a FIFO, a device or a folder refused: none is
    read), and read no further than `limit` + 1 bytes (a file that grew since). ValueError naming
    `what`, the file and, for bytes that are not UTF-8, the line (`FileTooLargeError` for the
    size); OSError naming them when it cannot be opened."""
    where = f"{what} {os.fspath(path)}"
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise type(error)(error.errno, f"{where}: cannot open it: {error.strerror}") from None
    with os.fdopen(descriptor, "rb") as handle:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{where}: not a regular file (a FIFO, a device or a folder): not read")
        if status.st_size > limit:
            raise FileTooLargeError(
                f"{where}: {status.st_size:,} bytes, past the {limit:,} it may have: not read"
            )
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise FileTooLargeError(f"{where}: more than {limit:,} bytes (it grew while read): not read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{where}, line {line}: not UTF-8 text (byte {error.start}: {error.reason})"
        ) from None


def read_json_object(
    path: str | os.PathLike, what: str, error: type[ValueError] = ValueError
) -> dict[str, Any]:
    """The JSON object in `path` (size-checked first); `error` for invalid JSON or a non-object."""
    text = read_text(path, what)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as problem:
        raise error(f"{os.fspath(path)} is not valid JSON: {problem}") from None
    if not isinstance(value, dict):
        raise error(f"{os.fspath(path)} must hold a JSON object ({what}), got {type(value).__name__}")
    return value
