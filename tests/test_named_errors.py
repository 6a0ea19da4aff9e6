"""Bad input gets a kvcache error that names the argument or file, what was expected and what was
given, never a traceback from deep inside torch, safetensors or tokenizers."""

from __future__ import annotations

import shutil

import pytest
import torch

import kvcache
from kvcache.defaults import default_model_dir
from kvcache.model import CheckpointError
from kvcache.text.tokenizer import TokenizerError

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture(scope="module")
def model():
    return kvcache.load_model()


@pytest.mark.parametrize("keep", [0, 7, 1000])
def test_a_truncated_safetensors_file_is_a_checkpoint_error(tmp_path, keep):
    folder = tmp_path / "m"
    shutil.copytree(default_model_dir(), folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        kvcache.load_model(folder)


@pytest.mark.parametrize("ids, match", [
    (torch.tensor([[1.0, 2.0]]), "integer token ids"),
    (torch.tensor([[True, False]]), "integer token ids"),
])
def test_ids_of_the_wrong_dtype_are_named(model, ids, match):
    with pytest.raises(ValueError, match=match):
        kvcache.generate(model, ids, max_new_tokens=2)
    with pytest.raises(ValueError, match=match):
        model(ids)


def test_a_mask_of_other_values_or_shape_is_named(model):
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match=r"1 \(token\) and 0 \(padding\) only, got values \[1, 2\]"):
        kvcache.generate(model, ids, torch.tensor([[1, 2, 1]]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"attention_mask must be a \(batch=1"):
        kvcache.generate(model, ids, torch.ones(2, 3, dtype=torch.long), max_new_tokens=2)


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_temperature_that_is_not_a_finite_positive_number_is_named(model, temperature):
    with pytest.raises(ValueError, match="temperature must be > 0 and finite"):
        kvcache.generate(model, torch.tensor([[1, 2]]), max_new_tokens=2, do_sample=True,
                         temperature=temperature)


@pytest.mark.parametrize("pad", [10**6, -1])
def test_a_pad_token_id_outside_the_vocabulary_is_named(model, pad):
    with pytest.raises(ValueError, match=r"pad_token_id must be a token id in \[0, 1024\)"):
        kvcache.generate(model, torch.tensor([[1, 2]]), max_new_tokens=2, pad_token_id=pad)


def test_decoding_a_negative_id_is_a_tokenizer_error():
    tokenizer = kvcache.load_tokenizer()
    with pytest.raises(TokenizerError, match=r"token ids must be >= 0.*\[-1\]"):
        tokenizer.decode([5, -1])
    assert tokenizer.decode([10**6]) == ""  # past the vocabulary (a padded embedding row): nothing


def _copy(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(default_model_dir(), folder)
    return folder


def test_an_eos_token_missing_from_the_vocabulary_is_named(tmp_path):
    import json

    folder = _copy(tmp_path)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "eos_token": "<|nowhere|>"}))
    with pytest.raises(TokenizerError, match=r"eos_token '<\|nowhere\|>' .* not in tokenizer.json"):
        kvcache.load_tokenizer(folder)


@pytest.mark.parametrize("field, value, match", [
    ("rope_parameters", "fast", "rope_parameters must be a JSON object"),
    ("eos_token_id", "two", "eos_token_id must be token ids"),
    ("eos_token_id", [2, 10**6], "eos_token_id must be token ids"),
    ("num_hidden_layers", "4", "num_hidden_layers must be a positive integer"),
])
def test_a_config_of_the_wrong_types_is_named(tmp_path, field, value, match):
    import json

    from kvcache.model import ConfigError

    folder = _copy(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ConfigError, match=match):
        kvcache.load_model(folder)


def test_weights_stored_as_integers_are_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = _copy(tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].to(torch.int32)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.norm.weight is stored as torch.int32"):
        kvcache.load_model(folder)
