"""The bounded GGUF reader: every count and length a hostile file declares is checked against the
bytes it holds before anything is read or allocated, memory stays proportional to the file, and
each malformed file is refused by a named error (CheckpointError / TokenizerError) saying what."""

from __future__ import annotations

import json
import struct
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf_files import write_gguf

from kvcache import load_model, load_tokenizer
from kvcache.model import CheckpointError
from kvcache.model.gguf_reader import MAX_FIELDS, MAX_STRINGS, read_gguf
from kvcache.text.tokenizer import TokenizerError

V = gguf.GGUFValueType


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _file(tmp_path, *, fields: bytes = b"", field_count: int = 0, tensors: bytes = b"",
          tensor_count: int = 0, version: int = 3, tail: bytes = b"") -> str:
    path = tmp_path / "hostile.gguf"
    header = b"GGUF" + struct.pack("<IQQ", version, tensor_count, field_count)
    path.write_bytes(header + fields + tensors + tail)
    return str(path)


def _array_field(key: str, element_type: int, count: int, payload: bytes = b"") -> bytes:
    return _string(key) + struct.pack("<IIQ", V.ARRAY, element_type, count) + payload


def _tensor(name: str, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def test_an_array_declaring_two_to_the_forty_bytes_is_refused_by_every_entry_point(tmp_path, capsys):
    from kvcache.cli import main

    path = _file(tmp_path, fields=_array_field("general.bomb", V.UINT8, 2**40), field_count=1)
    assert len(open(path, "rb").read()) < 80
    for read in (read_gguf, load_model, load_tokenizer):
        with pytest.raises((CheckpointError, TokenizerError), match="1,099,511,627,776 bytes"):
            read(path)
    assert main(["memory", "--config", path, "--tokens", "10"]) != 0
    assert "1,099,511,627,776 bytes" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields, count, message",
    [
        (_array_field("tokenizer.ggml.tokens", V.STRING, MAX_STRINGS + 1), 1, "reads at most 1,048,576"),
        (_array_field("tokenizer.ggml.tokens", V.STRING, 10**6), 1, "needs 8,000,000 bytes"),
        (b"", 2_000_000, f"declares 2,000,000 metadata fields; kvcache reads at most {MAX_FIELDS:,}"),
        (_string("general.name") + struct.pack("<IQ", V.STRING, 2**62), 1, "capped at"),
        (_string("general.name") + struct.pack("<IQ", V.STRING, 500) + b"x", 1, "needs 500 bytes"),
        (_array_field("general.nested", V.ARRAY, 1), 1, "arrays of numbers and strings"),
        (_string("general.flag") + struct.pack("<IB", V.BOOL, 2), 1, "a bool stored as 2"),
        (_string("general.what") + struct.pack("<IB", 77, 0), 1, "value type 77"),
        (_string(b"\xff\xfe") + struct.pack("<IB", V.UINT8, 0), 1, "not UTF-8"),
        (_string("a") + struct.pack("<IB", V.UINT8, 0) + _string("a") + struct.pack("<IB", V.UINT8, 0), 2,
         "appears twice"),
    ],
)
def test_a_declared_size_the_file_cannot_hold_is_refused_by_name(tmp_path, fields, count, message):
    with pytest.raises(CheckpointError, match=message):
        read_gguf(_file(tmp_path, fields=fields, field_count=count))


def test_versions_and_byte_orders_not_read_here_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="version 1 is not read here"):
        read_gguf(_file(tmp_path, version=1))
    with pytest.raises(CheckpointError, match="looks big-endian"):
        read_gguf(_file(tmp_path, version=3 << 24))
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        read_gguf(tmp_path / "empty.gguf")


F32 = int(gguf.GGMLQuantizationType.F32)


@pytest.mark.parametrize(
    "records, count, message",
    [
        (_tensor("a", (8,), F32, 0) + _tensor("b", (8,), F32, 0), 2, "overlap"),
        (_tensor("a", (8,), F32, 0) + _tensor("a", (8,), F32, 32), 2, "appears twice"),
        (_tensor("a", (8,), F32, 4), 1, "not aligned"),
        (_tensor("a", (1 << 40,), F32, 0), 1, "runs past the end"),
        (_tensor("a", (8,), 999, 0), 1, "type 999"),
        (_tensor("a", (8, 0), F32, 0), 1, "whole F32 blocks"),
        (_tensor("a", (16,), int(gguf.GGMLQuantizationType.Q8_0), 0), 1, "whole Q8_0 blocks of 32"),
        (_string("a") + struct.pack("<I", 5), 1, "has 5 dimensions"),
        (b"", 2**40, "declares 1,099,511,627,776 tensors"),
    ],
)
def test_a_tensor_record_that_does_not_fit_the_file_is_refused_by_name(tmp_path, records, count, message):
    with pytest.raises(CheckpointError, match=message):
        read_gguf(_file(tmp_path, tensors=records, tensor_count=count, tail=bytes(96)))


def _peak_bytes_reading(path) -> tuple[object, int]:
    tracemalloc.start()
    try:
        read = read_gguf(path)
        return read, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_tensors_and_numeric_arrays_are_views_of_the_file_not_copies(tmp_path):
    fields = _array_field("tokenizer.ggml.token_type", V.INT32, 1 << 20, bytes(4 << 20))
    records = _tensor("w", (256, 1024), F32, 0)
    unpadded = _file(tmp_path, fields=fields, field_count=1, tensors=records, tensor_count=1)
    pad = -len(open(unpadded, "rb").read()) % 32
    weights = np.arange(256 * 1024, dtype=np.float32)
    path = _file(tmp_path, fields=fields, field_count=1, tensors=records, tensor_count=1,
                 tail=bytes(pad) + weights.tobytes())
    read, peak = _peak_bytes_reading(path)
    assert read.fields["tokenizer.ggml.token_type"].shape == (1 << 20,)
    assert np.array_equal(read.tensors[0].data.view(np.float32), weights)
    assert peak < (1 << 20) // 4  # a 4 MiB array and a 1 MiB tensor in the file


def test_a_vocabulary_costs_a_few_times_its_bytes_in_the_file(tmp_path):
    tokens = [f"t{index}" for index in range(200_000)]
    fields = _array_field("tokenizer.ggml.tokens", V.STRING, len(tokens), b"".join(map(_string, tokens)))
    read, peak = _peak_bytes_reading(_file(tmp_path, fields=fields, field_count=1))
    assert read.fields["tokenizer.ggml.tokens"] == tokens
    assert peak < 6 * sum(8 + len(t) for t in tokens)  # str objects and the list's pointers


def _tokenizer_file(checkpoints, tmp_path, **fields):
    return write_gguf(checkpoints["llama"][0], tmp_path / "t.gguf", fields=fields)


def test_a_tokenizers_malformed_fields_are_named(checkpoints, tmp_path):
    vocab = json.loads((checkpoints["llama"][0] / "config.json").read_text())["vocab_size"]
    cases = {
        "add_bos_token must be a bool": {"tokenizer.ggml.add_bos_token": ("false", V.STRING)},
        "token_type must be": {"tokenizer.ggml.token_type": ([1, 1, 1], V.ARRAY, V.INT32)},
        "type outside 0..6": {"tokenizer.ggml.token_type": ([9] * vocab, V.ARRAY, V.INT32)},
        "do not form a BPE tokenizer": {"tokenizer.ggml.merges": (["zzqq xxyy"], V.ARRAY, V.STRING)},
        "merges must be a list of strings": {"tokenizer.ggml.merges": ([1, 2], V.ARRAY, V.INT32)},
    }
    for message, fields in cases.items():
        path = _tokenizer_file(checkpoints, tmp_path, **fields)
        with pytest.raises(TokenizerError, match=message):
            load_tokenizer(path)
