"""The plain-read safetensors reader: the library's values exactly, and refusals of damaged files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvcache.model.errors import CheckpointError
from kvcache.model.safetensors_read import read_header, read_tensors


@pytest.fixture
def stored(tmp_path):
    torch.manual_seed(0)
    tensors = {
        "a.weight": torch.randn(5, 3),
        "b.half": torch.randn(7).half(),
        "c.bf16": torch.randn(2, 2, 2).bfloat16(),
        "d.ints": torch.arange(6, dtype=torch.int64).reshape(3, 2),
        "e.empty": torch.zeros(0, 4),
        "f.scalar": torch.tensor(2.5),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_reads_what_the_library_reads(stored):
    path, tensors = stored
    read = read_tensors(path, set(tensors))
    reference = load_file(str(path))
    assert set(read) == set(tensors)
    for name, tensor in read.items():
        assert tensor.dtype == reference[name].dtype and tensor.shape == reference[name].shape
        assert torch.equal(tensor, reference[name]), name
    assert set(read_tensors(path, {"a.weight"})) == {"a.weight"}


def _rewrite(path, header: dict | None = None, *, length: int | None = None, cut: int = 0) -> None:
    raw = path.read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    body = raw[8 + size :]
    head = raw[8 : 8 + size] if header is None else json.dumps(header).encode()
    data = struct.pack("<Q", len(head) if length is None else length) + head + body
    path.write_bytes(data[: len(data) - cut])


def test_damaged_files_are_refused_by_name(stored):
    path, tensors = stored
    header, _ = read_header(path)

    _rewrite(path, length=10**12)  # a header longer than the file
    with pytest.raises(CheckpointError, match="header length"):
        read_tensors(path, {"a.weight"})

    _rewrite(path, {**header, "a.weight": {**header["a.weight"], "dtype": "F8_E4M3"}}, length=None)
    with pytest.raises(CheckpointError, match="a.weight has dtype"):
        read_tensors(path, {"a.weight"})

    wrong_shape = {**header, "a.weight": {**header["a.weight"], "shape": [5, 4]}}
    _rewrite(path, wrong_shape)
    with pytest.raises(CheckpointError, match="does not fit its byte range"):
        read_tensors(path, {"a.weight"})

    beyond = {**header, "a.weight": {**header["a.weight"], "data_offsets": [10**9, 10**9 + 60]}}
    _rewrite(path, beyond)
    with pytest.raises(CheckpointError, match="does not fit"):
        read_tensors(path, {"a.weight"})

    _rewrite(path, header)
    with pytest.raises(CheckpointError, match="lacks tensor"):
        read_tensors(path, {"nope"})


def test_a_truncated_file_is_refused(stored):
    path, _ = stored
    _rewrite(path, cut=8)  # the last tensor's bytes are cut short
    with pytest.raises(CheckpointError):
        read_tensors(path, {"a.weight", "b.half", "c.bf16", "d.ints", "f.scalar"})
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="too short"):
        read_tensors(path, {"a.weight"})
