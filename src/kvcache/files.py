"""Reading a stranger's small files (config.json, tokenizer settings, chat templates, shard
indexes): the size is checked before a byte is read, so an 8 GiB "config.json" is refused at
once instead of filling memory; standard library only (the memory planner uses it too)."""

from __future__ import annotations

import json
import os
from pathlib import Path
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
    """The UTF-8 text of `path` (at most `limit` bytes); ValueError naming the file otherwise."""
    check_size(path, limit, what)
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{os.fspath(path)} is not UTF-8 text ({what}): {error}") from None


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
