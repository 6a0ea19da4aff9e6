"""A bounded reader of llama.cpp's GGUF container: the header, the metadata fields and where each
tensor's bytes lie, over a read-only memory map of the file.

The file is untrusted, so every count and length it declares is checked against the bytes left
before anything is read or allocated (a 76-byte file may declare an array of 2**40 elements),
string arrays and the number of fields and tensors are capped, and numeric arrays and tensor data
are numpy views of the map (no copy): memory stays proportional to the file. Tensors must lie
inside the data section, aligned, without overlapping. Only little-endian files of GGUF versions 2
and 3 are read; nested arrays (which no converter writes) are refused.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.model.errors import CheckpointError

MAX_FIELDS = 65_536  # metadata fields in one file (a converted model writes ~40)
MAX_TENSORS = 65_536
MAX_STRINGS = 1 << 20  # strings in one array: vocabularies and merge lists (the largest ~262k)
MAX_STRING_BYTES = 1 << 24  # one string (a chat template is ~10 KiB)
MAX_DIMS = 4  # ggml's limit
DEFAULT_ALIGNMENT = 32
_MAGIC = b"GGUF"
_STRING, _ARRAY, _BOOL = 8, 9, 7
# value type -> struct/numpy format of one element
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's record: `shape` innermost dimension first (as GGUF lists it), `tensor_type`
    a `gguf.GGMLQuantizationType`, `data` its bytes (uint8, a view of the mapped file)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from `view`, refusing any read past its end."""

    def __init__(self, view, source: str) -> None:
        self.view, self.source, self.at = view, source, 0

    def left(self) -> int:
        return len(self.view) - self.at

    def need(self, count: int, what: str) -> None:
        if count < 0 or count > self.left():
            raise CheckpointError(
                f"{self.source} is not a readable GGUF file: {what} needs {count:,} bytes at offset "
                f"{self.at:,}; the file has {self.left():,} left"
            )

    def scalar(self, code: str, what: str):
        size = struct.calcsize("<" + code)
        self.need(size, what)
        (value,) = struct.unpack_from("<" + code, self.view, self.at)
        self.at += size
        return value

    def string(self, what: str) -> str:
        length = self.scalar("Q", what)
        if length > MAX_STRING_BYTES:
            raise CheckpointError(
                f"{self.source}: {what} declares {length:,} bytes; "
                f"strings are capped at {MAX_STRING_BYTES:,}"
            )
        self.need(length, what)
        raw = bytes(self.view[self.at : self.at + length])
        self.at += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.source}: {what} is not UTF-8 text") from None


def _value(cursor: _Cursor, kind: int, what: str) -> Any:
    """One metadata value of type `kind`."""
    if kind == _STRING:
        return cursor.string(what)
    if kind == _ARRAY:
        return _array(cursor, what)
    if kind not in _SCALARS:
        raise CheckpointError(f"{cursor.source}: {what} has value type {kind}, not a GGUF type")
    value = cursor.scalar(_SCALARS[kind], what)
    if kind == _BOOL:
        if value not in (0, 1):
            raise CheckpointError(f"{cursor.source}: {what} is a bool stored as {value}")
        return bool(value)
    return value


def _array(cursor: _Cursor, what: str) -> Any:
    """An array: strings as a list of str, numbers as a read-only numpy view of the file."""
    kind = cursor.scalar("I", what)
    count = cursor.scalar("Q", what)
    if kind == _STRING:
        if count > MAX_STRINGS:
            raise CheckpointError(
                f"{cursor.source}: {what} holds {count:,} "
                f"strings; kvcache reads at most {MAX_STRINGS:,}"
            )
        cursor.need(count * 8, f"{what} ({count:,} strings)")  # each string's length alone is 8 bytes
        return _strings(cursor, count, what)
    if kind not in _SCALARS:
        raise CheckpointError(
            f"{cursor.source}: {what} is an array of value type "
            f"{kind}; kvcache reads arrays of numbers and strings"
        )
    dtype = np.dtype("<" + _SCALARS[kind])
    cursor.need(count * dtype.itemsize, f"{what} ({count:,} elements)")
    values = np.frombuffer(cursor.view, dtype=dtype, count=count, offset=cursor.at)
    cursor.at += count * dtype.itemsize
    if kind == _BOOL:
        if values.size and values.max() > 1:
            raise CheckpointError(f"{cursor.source}: {what} holds a bool that is neither 0 nor 1")
        return values.astype(bool)
    return values


_LENGTH = struct.Struct("<Q")


def _strings(cursor: _Cursor, count: int, what: str) -> list[str]:
    """`count` strings, as `cursor.string` reads each, in a loop of its own (a vocabulary and its
    merges are ~100k strings: the method calls were most of a model's load)."""
    view, at, end, out = cursor.view, cursor.at, len(cursor.view), []
    for _ in range(count):
        if end - at < 8 or _LENGTH.unpack_from(view, at)[0] > min(end - at - 8, MAX_STRING_BYTES):
            cursor.at = at
            out.append(cursor.string(what))  # says what is wrong, with the offset
            at = cursor.at
            continue
        length = _LENGTH.unpack_from(view, at)[0]
        try:
            out.append(str(view[at + 8 : at + 8 + length], "utf-8"))
        except UnicodeDecodeError:
            raise CheckpointError(f"{cursor.source}: {what} is not UTF-8 text") from None
        at += 8 + length
    cursor.at = at
    return out


def _fields(cursor: _Cursor, count: int) -> dict[str, Any]:
    if count > MAX_FIELDS:
        raise CheckpointError(
            f"{cursor.source}: declares {count:,} metadata "
            f"fields; kvcache reads at most {MAX_FIELDS:,}"
        )
    cursor.need(count * 12, f"{count:,} metadata fields")  # each: a key length and a value type at least
    fields: dict[str, Any] = {}
    for index in range(count):
        key = cursor.string(f"metadata field {index}'s key")
        if key in fields:
            raise CheckpointError(f"{cursor.source}: metadata field {key!r} appears twice")
        fields[key] = _value(cursor, cursor.scalar("I", f"field {key!r}"), f"field {key!r}")
    return fields


def _tensor_records(cursor: _Cursor, count: int) -> list[tuple[str, tuple[int, ...], int, int]]:
    """(name, shape innermost first, type id, offset in the data section) of each tensor."""
    if count > MAX_TENSORS:
        raise CheckpointError(
            f"{cursor.source}: declares {count:,} tensors; "
            f"kvcache reads at most {MAX_TENSORS:,}"
        )
    cursor.need(count * 24, f"{count:,} tensor records")  # name length, dims, type and offset at least
    records, names = [], set()
    for index in range(count):
        name = cursor.string(f"tensor {index}'s name")
        if name in names:
            raise CheckpointError(f"{cursor.source}: tensor {name!r} appears twice")
        names.add(name)
        dims = cursor.scalar("I", f"tensor {name!r}")
        if not 1 <= dims <= MAX_DIMS:
            raise CheckpointError(
                f"{cursor.source}: tensor {name!r} has {dims} "
                f"dimensions; GGUF allows 1 to {MAX_DIMS}"
            )
        what = f"tensor {name!r}"
        shape = tuple(cursor.scalar("Q", what) for _ in range(dims))
        records.append((name, shape, cursor.scalar("I", what), cursor.scalar("Q", what)))
    return records


def _tensor(view, source: str, record, data_start: int, alignment: int) -> GGUFTensor:
    """One tensor record checked (known type, whole blocks, aligned, inside the file) and viewed."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name, shape, type_id, offset = record
    try:
        kind = GGMLQuantizationType(type_id)
        block, block_bytes = GGML_QUANT_SIZES[kind]
    except (ValueError, KeyError):
        raise CheckpointError(f"{source}: tensor {name!r} has type {type_id}, not a ggml type") from None
    if min(shape) < 1 or shape[0] % block:
        raise CheckpointError(
            f"{source}: tensor {name!r} has shape {shape}; its "
            f"rows must be whole {kind.name} blocks of {block}"
        )
    elements = int(np.prod(shape, dtype=object))
    size = elements // block * block_bytes
    start = data_start + offset
    if offset % alignment or start + size > len(view):
        raise CheckpointError(
            f"{source}: tensor {name!r} ({size:,} bytes at data offset {offset:,}) is not aligned to "
            f"{alignment} or runs past the end of the file ({len(view):,} bytes)"
        )
    data = np.frombuffer(view, dtype=np.uint8, count=size, offset=start)
    return GGUFTensor(name, kind, shape, data)


def _check_disjoint(tensors: list[GGUFTensor], source: str) -> None:
    spans = sorted((t.data.__array_interface__["data"][0], t.data.size, t.name) for t in tensors)
    for (start, size, name), (next_start, _, other) in zip(spans, spans[1:]):
        if start + size > next_start:
            raise CheckpointError(f"{source}: tensors {name!r} and {other!r} overlap in the file")


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file read: `fields` (key -> str, int, float, bool, list of str or numpy array) and
    `tensors` (in file order, their data viewed over the mapped file)."""

    fields: dict[str, Any]
    tensors: list[GGUFTensor]


def read_gguf(path: str | Path) -> GGUFFile:
    """The file at `path` read and checked; CheckpointError names what is wrong with a bad one."""
    source = str(path)
    try:
        with open(path, "rb") as handle:
            view = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:  # ValueError: an empty file cannot be mapped
        raise CheckpointError(f"{source} is not a readable GGUF file: {error}") from None
    cursor = _Cursor(view, source)
    if len(view) < 4 or view[:4] != _MAGIC:
        raise CheckpointError(f"{source} is not a GGUF file (it does not start with {_MAGIC!r})")
    cursor.at = 4
    version = cursor.scalar("I", "the version")
    if version not in (2, 3):
        swapped = version > 0xFFFF
        raise CheckpointError(
            f"{source}: GGUF version {version} is not read here (versions 2 and 3, little-endian"
            + ("; this file looks big-endian)" if swapped else ")")
        )
    tensor_count, field_count = cursor.scalar("Q", "the tensor count"), cursor.scalar("Q", "the field count")
    fields = _fields(cursor, field_count)
    records = _tensor_records(cursor, tensor_count)
    alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment & (alignment - 1):
        raise CheckpointError(f"{source}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cursor.at // alignment) * alignment
    tensors = [_tensor(view, source, record, data_start, alignment) for record in records]
    _check_disjoint(tensors, source)
    return GGUFFile(fields, tensors)
