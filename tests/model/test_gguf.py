"""GGUF files: config, tensors and tokenizer read from the file equal the checkpoint they were
written from and transformers' own reading of the same file; bad files are refused by name."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from gguf_files import write_gguf

from kvcache import load_model, load_tokenizer
from kvcache.defaults import default_model_dir
from kvcache.model import CheckpointError
from kvcache.text.tokenizer import TokenizerError

TEXTS = ["Hello, what's your name?", "The quick brown fox 1234 jumps.\n\n  over  the lazy dog", "ünïcödé 😀"]
IDS = torch.tensor([[1, 5, 77, 200, 3, 9, 140, 33, 250, 12, 18]])


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _transformers_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_an_f32_file_gives_the_checkpoints_weights_exactly(checkpoints, tmp_path, arch):
    folder, _ = checkpoints[arch]
    path = write_gguf(folder, tmp_path / f"{arch}.gguf")
    from_file, from_folder = load_model(path), load_model(folder)
    assert from_file.config.model_type == arch
    theirs = from_folder.state_dict()
    for name, tensor in from_file.state_dict().items():  # the q/k permutation undone exactly
        torch.testing.assert_close(tensor, theirs[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_logits_equal_transformers_reading_the_same_file(checkpoints, tmp_path, arch, tensor_type):
    folder, _ = checkpoints[arch]
    path = write_gguf(folder, tmp_path / f"{arch}-{tensor_type}.gguf", tensor_type=tensor_type)
    ours, theirs = _logits(load_model(path)), _logits(_transformers_model(path))
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    if tensor_type != "F32":  # the quantized weights are not the checkpoint's: logits move
        assert not torch.equal(ours, _logits(load_model(folder)))


def test_a_qwen3_file_gives_the_logits_of_the_transformers_model_it_came_from(checkpoints, tmp_path):
    """transformers' GGUF reader takes qwen3's head_dim from its default, not the file's key
    length, so the anchor here is the transformers model the checkpoint was saved from."""
    folder, theirs = checkpoints["qwen3"]
    path = write_gguf(folder, tmp_path / "qwen3.gguf")
    torch.testing.assert_close(_logits(load_model(path)), _logits(theirs), atol=1e-4, rtol=1e-4)


def test_a_dtype_is_applied_to_the_dequantized_weights(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"][0], tmp_path / "m.gguf", tensor_type="Q8_0")
    assert load_model(path).dtype == torch.float32
    assert load_model(path, dtype="bfloat16").dtype == torch.bfloat16


@pytest.fixture(scope="module")
def default_tokenizer_files(tmp_path_factory):
    """The bundled model (its tokenizer has merges) as GGUF files with three pre-tokenizers."""
    root = tmp_path_factory.mktemp("gguf")
    return {
        pre: write_gguf(default_model_dir(), root / f"{pre}.gguf", pre=pre, arch=arch)
        for pre, arch in (("gpt-2", "llama"), ("smollm", "llama"), ("qwen2", "qwen2"))
    }


def test_the_files_tokenizer_gives_the_folders_ids_and_template(default_tokenizer_files):
    ours, reference = load_tokenizer(default_tokenizer_files["gpt-2"]), load_tokenizer(default_model_dir())
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text), skip_special_tokens=True) == text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(messages)
    assert (ours.bos_token, ours.eos_token) == (reference.bos_token, reference.eos_token)


@pytest.mark.parametrize("pre", ["gpt-2", "qwen2"])
def test_the_files_tokenizer_equals_transformers_reading_of_it(default_tokenizer_files, pre):
    from transformers import AutoTokenizer

    path = default_tokenizer_files[pre]
    ours = load_tokenizer(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text


def test_smollms_split_takes_digits_one_at_a_time_as_llama_cpp_does(default_tokenizer_files):
    """transformers reads 'smollm' as plain GPT-2 splitting; llama.cpp (and the model's own
    tokenizer.json) split every digit off first."""
    smollm, gpt2 = (load_tokenizer(default_tokenizer_files[pre]) for pre in ("smollm", "gpt-2"))
    text = "In 2024 there were 12345 of them"
    ids = smollm.encode(text, add_special_tokens=False)
    pieces = [smollm.decode([token]) for token in ids]
    digits = [piece for piece in pieces if any(ch.isdigit() for ch in piece)]
    assert "".join(digits) == "202412345" and all(len(piece) == 1 for piece in digits)
    assert len(gpt2.encode(text, add_special_tokens=False)) < len(ids)  # merges join digits there
    assert smollm.decode(ids) == text


def test_a_file_that_is_not_gguf_and_a_truncated_one_are_refused(checkpoints, tmp_path):
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x80\x04not a gguf")
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        load_model(other)
    path = write_gguf(checkpoints["llama"][0], tmp_path / "m.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError):
        load_model(cut)


def test_an_architecture_we_do_not_load_is_refused_by_name(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"][0], tmp_path / "m.gguf", arch="starcoder2")
    with pytest.raises(CheckpointError, match="architecture 'starcoder2' is not supported"):
        load_model(path)


def test_a_tensor_whose_shape_disagrees_with_the_metadata_is_refused_before_reading(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"][0], tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    key = b"llama.embedding_length"
    at = data.index(key) + len(key) + 4  # after the name: the value's type (uint32), then the value
    (hidden,) = struct.unpack_from("<I", data, at)
    struct.pack_into("<I", data, at, hidden * 2)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(bad)


def test_a_pre_tokenizer_we_do_not_know_is_refused_by_name(checkpoints, tmp_path):
    path = write_gguf(checkpoints["llama"][0], tmp_path / "m.gguf", pre="deepseek-coder")
    with pytest.raises(TokenizerError, match="'deepseek-coder'"):
        load_tokenizer(path)


def test_kvcache_memory_reads_a_gguf_files_shape(checkpoints, tmp_path, capsys):
    from kvcache.cli import main

    folder, _ = checkpoints["qwen3"]
    path = write_gguf(folder, tmp_path / "m.gguf")
    config = json.loads((folder / "config.json").read_text())
    assert main(["memory", "--config", str(path), "--tokens", "10", "--dtype", "float32"]) == 0
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    assert f"per token (all layers growing): {per_token:,} B" in capsys.readouterr().out


def test_loading_reports_progress_over_the_tensors_of_a_file_and_a_folder(checkpoints, tmp_path):
    folder, _ = checkpoints["llama"]
    for source in (write_gguf(folder, tmp_path / "llama.gguf"), folder):
        calls: list[tuple[float, str]] = []
        load_model(source, progress=lambda fraction, label, calls=calls: calls.append((fraction, label)))
        fractions = [fraction for fraction, _ in calls]
        assert calls[0] == (0.0, "reading tensors") and calls[-1] == (1.0, "done")
        assert fractions == sorted(fractions) and all(0 <= f <= 1 for f in fractions)
        if source != folder:  # a file: a call per tensor
            assert len(calls) > 10


def test_a_loaded_file_replaced_by_rename_leaves_the_model_as_it_was(checkpoints, tmp_path):
    """Blocks kept as stored are views of a memory map (docs/model.md): replacing the file by
    writing another one and renaming it over it leaves a loaded model reading the old file."""
    folder, _ = checkpoints["llama"]
    path = write_gguf(folder, tmp_path / "model.gguf", tensor_type="Q8_0")
    model = load_model(path)
    before = _logits(model)
    replacement = tmp_path / "replacement.gguf"
    replacement.write_bytes(b"\0" * path.stat().st_size)
    replacement.replace(path)
    torch.testing.assert_close(_logits(model), before, atol=0, rtol=0)
