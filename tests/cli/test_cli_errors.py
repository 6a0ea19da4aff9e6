"""`kvcache generate` on broken inputs prints one line naming the fault and exits 2; warnings
are one line too; the sampling settings it used are the flags', else generation_config.json's."""

from __future__ import annotations

import json
import shutil
import struct

import pytest

from kvcache.cli import main
from kvcache.defaults import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


@pytest.fixture
def model_copy(tmp_path):
    return shutil.copytree(DEFAULT_MODEL_DIR, tmp_path / "model")


def _generate(folder, *extra) -> list[str]:
    return ["generate", "--model", str(folder), "--prompt", "The", "--max-new-tokens", "3", *extra]


def _edit_json(path, **changes) -> None:
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _truncate_weights(folder) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def _integer_weights(folder) -> None:
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    name = next(n for n in header if n != "__metadata__")
    header[name]["dtype"] = "I32"  # same width as F32: only the stored type is wrong
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= size
    text += b" " * (size - len(text))
    weights.write_bytes(data[:8] + text[:size] + data[8 + size :])


BREAKAGES = {
    "truncated safetensors": (_truncate_weights, "model.safetensors"),
    "integer weights": (_integer_weights, "int32"),
    "config.json a list": (lambda f: (f / "config.json").write_text("[1, 2]"), "JSON object"),
    "config of the wrong types": (lambda f: _edit_json(f / "config.json", hidden_size="64"), "hidden_size"),
    "malformed tokenizer.json": (lambda f: (f / "tokenizer.json").write_text("{not json"), "tokenizer"),
    "eos_token missing from the vocabulary": (
        lambda f: _edit_json(f / "tokenizer_config.json", eos_token="<no such token>"), "<no such token>"),
}


@pytest.mark.parametrize("case", list(BREAKAGES))
def test_a_broken_checkpoint_is_one_line_naming_it_and_exit_2(model_copy, capsys, case):
    breaks, named = BREAKAGES[case]
    breaks(model_copy)
    assert main(_generate(model_copy)) == 2
    captured = capsys.readouterr()
    # (the load's bar may draw its line first on a busy machine: loading took past its delay)
    lines = [line for line in captured.err.strip().splitlines() if " [#" not in line]
    assert len(lines) == 1 and lines[0].startswith("kvcache generate: error: "), captured.err
    assert named in lines[0] and captured.out == ""


def test_a_nan_temperature_is_one_line_and_nothing_on_stdout(capsys):
    assert main(_generate(DEFAULT_MODEL_DIR, "--temperature", "nan")) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    said = [line for line in captured.err.splitlines() if "cores busy" not in line]  # (a busy machine's)
    assert len(said) == 1 and said[0].startswith("kvcache generate: error: ") and "temperature" in said[0]


def test_a_run_past_max_position_embeddings_is_fitted_to_it_in_one_line(model_copy, capsys):
    _edit_json(model_copy / "config.json", max_position_embeddings=6)
    assert main(_generate(model_copy, "--max-new-tokens", "8", "--stop", "never said")) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "fit a context of 6" in line]
    assert len(said) == 1 and said[0].startswith("kvcache generate: at most ")
    assert "warning" not in err  # nothing past the context ran, so nothing to warn of
    assert "next(" not in err and ".py:" not in err  # no source line, no file:line


def test_sampling_settings_come_from_the_flags_else_generation_config(model_copy, capsys):
    (model_copy / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9}))

    def run(*extra):
        assert main(_generate(model_copy, "--json", *extra)) == 0
        return json.loads(capsys.readouterr().out)

    chosen = run()
    settings = (chosen["do_sample"], chosen["temperature"], chosen["top_k"], chosen["top_p"])
    assert settings == (True, 0.7, 5, 0.9)
    flagged = run("--top-k", "2", "--temperature", "1.3")
    assert (flagged["temperature"], flagged["top_k"], flagged["top_p"]) == (1.3, 2, 0.9)
    assert run("--temperature", "0")["do_sample"] is False  # greedy, whatever the file says
    assert run("--top-p", "0.5", "--seed", "1")["top_p"] == 0.5


def test_top_p_alone_implies_sampling(capsys):
    assert main(_generate(DEFAULT_MODEL_DIR, "--json", "--top-p", "0.8")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["do_sample"] is True and report["top_p"] == 0.8


def test_min_p_and_repetition_penalty_flags_reach_generate(capsys):
    def run(*extra):
        assert main(_generate(DEFAULT_MODEL_DIR, "--json", "--max-new-tokens", "16", *extra)) == 0
        return json.loads(capsys.readouterr().out)

    greedy = run()
    only_likeliest = run("--min-p", "1", "--temperature", "2", "--seed", "5")
    assert only_likeliest["do_sample"] is True and only_likeliest["tokens"] == greedy["tokens"]
    penalized = run("--repetition-penalty", "1.8")
    assert penalized["repetition_penalty"] == 1.8 and penalized["tokens"] != greedy["tokens"]
    assert main(_generate(DEFAULT_MODEL_DIR, "--min-p", "2")) == 2
    assert "min_p must be a finite number in [0, 1], got 2.0" in capsys.readouterr().err


def test_an_unknown_flag_prints_the_commands_own_usage(capsys):
    with pytest.raises(SystemExit) as stopped:
        main(["memory", "--tokens", "10", "--no-such-flag"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvcache memory") and "unrecognized arguments: --no-such-flag" in err



@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_an_empty_kv_disk_is_a_usage_error_naming_the_flag(command, capsys):
    """--kv-disk '' would be the current folder (serve) or no disk tier at all (generate, chat):
    refused before anything loads, naming the flag."""
    with pytest.raises(SystemExit) as exit_:
        main([command, "--kv-disk", ""])
    assert exit_.value.code == 2
    assert "--kv-disk" in capsys.readouterr().err
