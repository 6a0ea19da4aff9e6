"""Reading tensors out of a .safetensors file with plain reads, into memory this process owns.

Why not `safe_open(...).get_tensor`: it returns views of a memory map of the file, which keeps
the whole mapping alive (and resident) as long as one tensor does, beside every copy made from
those tensors later. Here every tensor is read with `readinto` into a tensor allocated for it,
in file order, and nothing maps the file.

The header is the format's own (8-byte little-endian length, JSON, raw little-endian data).
Sizes are validated before anything is allocated: the header length against the file size, each
tensor's dtype, shape and byte range against each other and the file. The loader has already
opened the file with the safetensors library (names and shapes), which validates it as well.
"""

from __future__ import annotations

import ctypes
import json
import struct
import sys
from math import prod
from pathlib import Path

import torch

from kvcache.model.errors import CheckpointError

# safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 2**20  # the safetensors library's own limit


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """(tensor entries by name, offset of the data section) of a safetensors file."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise CheckpointError(f"{file.name} is too short to be a safetensors file ({size} bytes)")
        (header_bytes,) = struct.unpack("<Q", raw)
        if header_bytes > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(
                f"{file.name}: header length {header_bytes} exceeds the file ({size} bytes) "
                f"or the {MAX_HEADER_BYTES}-byte limit"
            )
        try:
            header = json.loads(handle.read(header_bytes))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise CheckpointError(f"{file.name}: the header is not JSON ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file.name}: the header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_bytes


def header_entry(
    file: Path, name: str, entry, data_start: int, file_size: int
) -> tuple[torch.dtype, list, int, int]:
    """(dtype, shape, begin, end) of one header entry, every field checked."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{file.name}: header entry {name!r} is not an object")
    dtype = DTYPES.get(entry.get("dtype"))
    if dtype is None:
        raise CheckpointError(
            f"{file.name}: tensor {name} has dtype {entry.get('dtype')!r}; supported: {sorted(DTYPES)}"
        )
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
        raise CheckpointError(f"{file.name}: tensor {name} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(n, int) for n in offsets)):
        raise CheckpointError(f"{file.name}: tensor {name} has data_offsets {offsets!r}")
    begin, end = offsets
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end or end - begin != prod(shape) * itemsize or data_start + end > file_size:
        raise CheckpointError(
            f"{file.name}: tensor {name} ({entry['dtype']}, shape {shape}) does not fit its byte "
            f"range {offsets} in a file of {file_size} bytes"
        )
    return dtype, shape, begin, end


def read_tensors(file: Path, names: set[str]) -> dict[str, torch.Tensor]:
    """The tensors `names` of a safetensors file, each in its own CPU tensor (stored dtype)."""
    if sys.byteorder != "little":  # the format is little-endian; let the library convert
        from safetensors.torch import load_file

        loaded = load_file(str(file))
        return {name: loaded[name] for name in names}
    header, data_start = read_header(file)
    file_size = file.stat().st_size
    absent = sorted(names - set(header))
    if absent:
        raise CheckpointError(f"{file.name} lacks tensor(s) {absent[:5]}")
    entries = {name: header_entry(file, name, header[name], data_start, file_size) for name in names}
    tensors: dict[str, torch.Tensor] = {}
    with open(file, "rb", buffering=0) as handle:
        for name in sorted(names, key=lambda n: entries[n][2]):  # in file order
            dtype, shape, begin, end = entries[name]
            tensor = torch.empty(shape, dtype=dtype)
            if end > begin:
                handle.seek(data_start + begin)
                target = (ctypes.c_char * (end - begin)).from_address(tensor.data_ptr())
                view = memoryview(target).cast("B")
                done = 0
                while done < len(view):  # readinto may return less than asked
                    count = handle.readinto(view[done:])
                    if not count:
                        raise CheckpointError(f"{file.name} ended inside tensor {name}")
                    done += count
            tensors[name] = tensor
    return tensors
