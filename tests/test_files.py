"""A stranger's small files are size-checked before they are read: an 8 GiB config.json (a
sparse file here) is refused at once, by name; malformed tokenizer files get named errors."""

from __future__ import annotations

import os
import shutil

import pytest

import kvcache
from kvcache.cli import main
from kvcache.defaults import default_model_dir
from kvcache.files import FileTooLargeError
from kvcache.text.tokenizer import TokenizerError


@pytest.fixture
def folder(tmp_path):
    copy = tmp_path / "model"
    shutil.copytree(default_model_dir(), copy)
    return copy


def huge(path) -> None:
    with open(path, "wb") as handle:
        handle.truncate(8 << 30)  # sparse: no disk used, nothing read when refused


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "chat_template.jinja"])
def test_an_oversized_file_is_refused_before_it_is_read(folder, name):
    huge(folder / name)
    if name == "tokenizer_config.json":
        (folder / "tokenizer_config.json").unlink()
        huge(folder / "special_tokens_map.json")
    with pytest.raises(FileTooLargeError, match="8,589,934,592 bytes"):
        if name == "config.json":
            kvcache.load_model(folder)
        else:
            if name == "chat_template.jinja":  # read when tokenizer_config.json has no template
                (folder / "tokenizer_config.json").write_text("{}")
            kvcache.load_tokenizer(folder)


def test_kvcache_memory_refuses_an_oversized_config_with_exit_2(folder, capsys):
    huge(folder / "config.json")
    assert main(["memory", "--config", str(folder), "--tokens", "8"]) == 2
    assert "8,589,934,592 bytes" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["generation_config.json", "tokenizer.json"])
def test_an_oversized_generation_config_or_tokenizer_json_is_refused_at_once(folder, capsys, name):
    huge(folder / name)
    assert main(["generate", "--model", str(folder), "--prompt", "The", "--max-new-tokens", "1"]) == 2
    # (the load's bar may draw its line first on a busy machine: loading took past its delay)
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True) if " [#" not in line)
    assert err.count("\n") == 1 and "8,589,934,592 bytes" in err and name in err


@pytest.mark.parametrize("content", ["not json", "[1, 2]", "\udcff"])
def test_malformed_tokenizer_files_are_named(folder, content):
    target = folder / "tokenizer_config.json"
    if content == "\udcff":
        target.write_bytes(b"\xff\xfe{}")
    else:
        target.write_text(content)
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        kvcache.load_tokenizer(folder)


def test_a_broken_tokenizer_json_is_a_tokenizer_error(folder):
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(TokenizerError, match="tokenizer.json is not a tokenizer file"):
        kvcache.load_tokenizer(folder)
    assert os.path.getsize(folder / "tokenizer.json") < 100


def test_an_api_keys_fifo_with_no_writer_is_refused_instead_of_waited_on(tmp_path):
    import threading

    from kvcache.server.tenants import read_api_keys

    fifo = tmp_path / "keys.fifo"
    os.mkfifo(fifo)
    said: list[str] = []

    def read() -> None:
        try:
            read_api_keys(fifo)
        except ValueError as error:
            said.append(str(error))

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    reading.join(60)
    if reading.is_alive():  # (blocked opening the FIFO: a writer lets it go, then the test fails)
        with open(fifo, "w"):
            pass
        reading.join(60)
    assert said == [f"--api-keys file {fifo}: not a regular file (a FIFO, a device or a folder): not read"]


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused_by_name_before_a_byte_is_read(device):
    from kvcache.files import read_text

    with pytest.raises(ValueError, match=f"^--api-keys {device}: not a regular file"):
        read_text(device, "--api-keys", 1 << 10)


def test_bytes_that_are_not_utf8_are_refused_naming_the_file_and_the_line(tmp_path):
    from kvcache.files import read_text

    path = tmp_path / "chat_template.jinja"
    path.write_bytes(b"fine\n\xff\n")
    with pytest.raises(ValueError, match=f"^chat template {path}, line 2: not UTF-8 text"):
        read_text(path, "chat template")
