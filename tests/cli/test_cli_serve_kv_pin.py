"""`kvcache serve --kv-pin FILE` refuses a file it cannot use before the model loads (the model
path given does not exist: had it been loaded first, that would be the error), naming the flag,
the file and the line, and says what it does while it prefills the pinned prompts."""

from __future__ import annotations

import json
import os
import threading
from types import SimpleNamespace

import pytest

from kvcache.cli import main
from kvcache.cli._pin_file import MAX_PINNED_PROMPTS, PIN_FILE_BYTES, pin_prompts, read_pin_file


def _refused(path, tmp_path, capsys, flags=()) -> str:
    """What serve says on stderr when it refuses `path` as --kv-pin (exit 2, no traceback)."""
    assert main(["serve", "--port", "0", *flags, "--kv-pin", str(path), "-m", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvcache serve: error: --kv-pin ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "lines, said",
    [
        (['[{"role": 5}]'],
         "line 1: messages[0].role must be one of system, developer, user, assistant; got 5"),
        (['"fine"', '[{"role": "user", "content": 7}]'],
         "line 2: messages[0].content must be a text, got int"),
        (['[{"role": "user", "content": "hi"}, "no"]'], "line 1: messages[1] must be an object"),
        (['"\\ud800"'], "line 1: the text holds a lone surrogate"),
        (['[{"role": "user", "content": "a\\udc00"}]'], "line 1: messages[0].content holds a lone surrogate"),
        (['""'], "line 1: an empty text"),
        (["[]"], "line 1: expected a text or a list of chat messages"),
        (['"fine"', "", '{"not": "a prompt"}'], "line 3: expected a text or a list of chat messages"),
        (['"fine"', "[" * 100_000], "line 2: "),
    ],
)
def test_a_bad_entry_is_refused_naming_the_flag_the_file_and_its_line(tmp_path, capsys, lines, said):
    pins = tmp_path / "pins.jsonl"
    pins.write_text("\n".join(lines) + "\n")
    assert f"--kv-pin {pins}, {said}" in _refused(pins, tmp_path, capsys)


def test_bytes_that_are_not_utf8_are_refused_naming_the_flag_the_file_and_the_line(tmp_path, capsys):
    pins = tmp_path / "pins.jsonl"
    pins.write_bytes(b'"fine"\n"\xff\xfe"\n')
    assert f"--kv-pin {pins}, line 2: not UTF-8 text" in _refused(pins, tmp_path, capsys)


def test_a_device_is_refused_before_it_is_read(tmp_path, capsys):
    assert "--kv-pin /dev/urandom: not a regular file" in _refused("/dev/urandom", tmp_path, capsys)


def test_a_fifo_with_no_writer_is_refused_instead_of_blocking_start(tmp_path, capsys):
    fifo = tmp_path / "pins.fifo"
    os.mkfifo(fifo)
    codes: list[int] = []
    starting = threading.Thread(target=lambda: codes.append(main(
        ["serve", "--port", "0", "--kv-pin", str(fifo), "-m", str(tmp_path / "absent")])), daemon=True)
    starting.start()
    starting.join(60)
    if starting.is_alive():  # (blocked opening the FIFO: a writer lets it go, then the test fails)
        with open(fifo, "w"):
            pass
        starting.join(60)
    assert codes == [2]
    assert f"--kv-pin {fifo}: not a regular file" in capsys.readouterr().err


def test_a_file_past_the_size_limit_is_refused_before_it_is_read(tmp_path, capsys):
    pins = tmp_path / "pins.jsonl"
    with open(pins, "wb") as handle:
        handle.truncate(PIN_FILE_BYTES + 1)  # (sparse: nothing written)
    assert f"--kv-pin {pins}: {PIN_FILE_BYTES + 1:,} bytes, past the {PIN_FILE_BYTES:,}" in _refused(
        pins, tmp_path, capsys)


def test_more_prompts_than_the_limit_are_refused_naming_the_first_line_past_it(tmp_path, capsys):
    pins = tmp_path / "pins.jsonl"
    pins.write_text('"a"\n' * (MAX_PINNED_PROMPTS + 1))
    said = _refused(pins, tmp_path, capsys)
    assert f"line {MAX_PINNED_PROMPTS + 1}: more than {MAX_PINNED_PROMPTS} prompts" in said


def test_the_limit_is_in_the_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert f"at most {MAX_PINNED_PROMPTS}" in " ".join(capsys.readouterr().out.split())


def test_entries_are_read_as_the_server_reads_messages(tmp_path):
    pins = tmp_path / "pins.jsonl"
    system = [{"role": "developer", "content": "Be terse.", "name": "ignored"}]
    pins.write_text(f"{json.dumps('a text')}\n\n{json.dumps(system)}\n")
    assert read_pin_file(str(pins)) == [(1, "a text"), (3, [{"role": "system", "content": "Be terse."}])]


class _Engine:
    """What pin_prompts uses of an Engine, recording what it said on stderr before prefilling."""

    def __init__(self, tokenizer, capsys) -> None:
        self.tokenizer, self.capsys = tokenizer, capsys
        self.model = SimpleNamespace(config=SimpleNamespace(vocab_size=tokenizer.vocab_size))
        self.pinned: list[list[int]] = []
        self.said_before_prefill = ""

    def pin(self, ids) -> int:
        self.pinned.append(ids)
        return len(ids) // 8 * 8

    def generate(self, prompts, params) -> None:
        self.said_before_prefill = self.capsys.readouterr().err
        assert prompts == self.pinned and params.max_tokens == 1


def test_pinning_says_what_it_prefills_before_the_pause_and_names_a_prompt_too_long(tmp_path, capsys):
    import kvcache

    engine = _Engine(kvcache.load_tokenizer(), capsys)
    pins = tmp_path / "pins.jsonl"
    pins.write_text('"You are a terse assistant."\n[{"role": "user", "content": "hi"}]\n')
    pin_prompts(engine, read_pin_file(str(pins)), str(pins), context=4096)
    assert "kvcache serve: pinning 2 prompts (--kv-pin): prefilling" in engine.said_before_prefill
    assert "kvcache serve: pinned 2 prompts" in capsys.readouterr().err
    pins.write_text('"short"\n' + json.dumps("word " * 100) + "\n")
    with pytest.raises(ValueError, match=f"--kv-pin {pins}, line 2: the prompt has \\d+ tokens; a request "
                                         "holds at most 64"):
        pin_prompts(engine, read_pin_file(str(pins)), str(pins), context=64)


@pytest.mark.parametrize("tenants", ["--api-keys", "--require-cache-salt"])
def test_pinning_beside_tenants_is_refused_at_start_naming_both_flags(tmp_path, capsys, tenants):
    # pinned blocks are unsalted: no tenant's salted request would reach them
    pins = tmp_path / "pins.jsonl"
    pins.write_text('"You are terse."\n')
    keys = tmp_path / "keys"
    keys.write_text("sk-one alice admin\n")  # (an admin key: no note about /metrics)
    keys.chmod(0o600)
    given = ["--api-keys", str(keys)] if tenants == "--api-keys" else [tenants]
    said = _refused(pins, tmp_path, capsys, given)
    assert f"--kv-pin cannot be used with {tenants}" in said
