"""`kvcache generate` streams text, prints timings, and compares with the no-cache path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcache.cli import main

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def test_generate_chat_streams_and_compares_with_no_cache(llama_dir, capsys):
    code = main(
        [
            "generate",
            "--model",
            str(llama_dir),
            "--chat",
            "Hello, what's your name.",
            "--max-new-tokens",
            "6",
            "--compare-nocache",
        ]
    )
    out = capsys.readouterr().err  # the statistics; stdout holds only the text
    assert code == 0
    assert "new tokens after a" in out and "cache paged" in out
    assert "time to first token" in out and "tokens/s" in out
    assert "tokens identical to the no-cache run: yes" in out
    assert "decode speed, cache paged / no cache:" in out
    warm, timed = out.index("warming up"), out.index("time to first token")
    assert warm < timed  # kernels compiled and weights laid out before anything is timed


def test_the_no_cache_rerun_is_said_before_it_starts(llama_dir, capsys):
    """--compare-nocache generates again, many times slower: stderr says so between the timed
    run's figures and the no-cache figures, so a long quiet wait has a reason on screen."""
    argv = ["generate", "--model", str(llama_dir), "--prompt", "The quick", "--max-new-tokens", "5",
            "--compare-nocache"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    said = err.index("kvcache generate: generating the 5 tokens again without a cache to compare")
    assert err.index("time to first token") < said < err.index("no cache: time to first token")


def test_generate_prompt_with_each_cache_kind(checkpoints, capsys):
    for arch, kind in (("llama", "static"), ("mistral", "sliding"), ("qwen2", "none")):
        folder = checkpoints[arch][0]
        code = main(
            [
                "generate",
                "--model",
                str(folder),
                "--prompt",
                "The quick",
                "--max-new-tokens",
                "4",
                "--cache",
                kind,
            ]
        )
        assert code == 0, arch
        assert f"cache {kind}" in capsys.readouterr().err


def test_generate_errors_are_one_line_and_exit_2(llama_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "absent"), "--prompt", "x"]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    assert main(["generate", "--model", str(llama_dir), "--prompt", "x", "--cache", "sliding"]) == 2
    assert "sliding_window" in capsys.readouterr().err


def test_building_the_parser_does_not_import_torch():
    code = "import sys, kvcache.cli; kvcache.cli.build_parser(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_summary_names_the_decode_path_that_ran(llama_dir, capsys):
    """float32 on CPU runs the float32 step by default, bfloat16 and float16 the half step; a
    forced torch backend runs the model's forward; the no-cache path runs the whole sequence
    again on the default backend, or on the model's forward with the torch one; the summary says
    which."""
    cases = [
        ([], "decode step float32"),
        (["--backend", "torch"], "decode step torch"),
        (["--dtype", "bfloat16"], "decode step half"),
        (["--dtype", "float16"], "decode step half"),
        (["--dtype", "bfloat16", "--backend", "torch"], "decode step torch"),
        (["--cache", "none"], "decode step float32"),
        (["--cache", "none", "--backend", "torch"], "decode step torch"),
    ]
    for extra, expected in cases:
        code = main(
            ["generate", "--model", str(llama_dir), "--prompt", "The quick", "--max-new-tokens", "3", *extra]
        )
        assert code == 0, extra
        assert expected in capsys.readouterr().err, extra
    assert (
        main(
            [
                "generate",
                "--model",
                str(llama_dir),
                "--prompt",
                "x",
                "--dtype",
                "bfloat16",
                "--backend",
                "float32",
            ]
        )
        == 2
    )
    assert "float32 backend cannot run this model" in capsys.readouterr().err


def test_stdout_holds_only_the_text_and_json_prints_one_object(llama_dir, capsys):
    import json

    base = ["generate", "--model", str(llama_dir), "--prompt", "The quick", "--max-new-tokens", "4"]
    assert main(base) == 0
    captured = capsys.readouterr()
    assert "tokens/s" not in captured.out and "tokens/s" in captured.err
    assert main(["generate", "--model", str(llama_dir), "--prompt", "The quick", "--max-new-tokens", "4",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["tokens"]) == 4 and report["do_sample"] is False and "decode_tokens_per_s" in report


def test_a_sampling_flag_implies_sampling_and_an_unseeded_run_prints_its_seed(llama_dir, capsys):
    import json

    def run(*extra):
        assert main(["generate", "--model", str(llama_dir), "--prompt", "The", "--max-new-tokens", "8",
                     "--json", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    first, second = run("--temperature", "1.5"), run("--temperature", "1.5")
    assert first["do_sample"] and first["seed"] != second["seed"]
    assert run("--temperature", "1.5", "--seed", str(first["seed"]))["tokens"] == first["tokens"]
    assert run("--temperature", "0")["do_sample"] is False  # llama.cpp's greedy
    assert run("--top-k", "5")["do_sample"] is True


def test_the_prompt_can_come_from_standard_input(llama_dir):
    command = [sys.executable, "-m", "kvcache", "generate", "--model", str(llama_dir), "--prompt", "-",
               "--max-new-tokens", "3", "--json"]
    done = subprocess.run(command, input="The quick brown", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    assert json.loads(done.stdout)["prompt_tokens"] > 1


def test_ctx_size_lowers_max_tokens_and_says_so_and_refuses_what_cannot_fit(llama_dir, capsys):
    import json

    args = ["generate", "-m", str(llama_dir), "--prompt", "one two three", "--json"]
    assert main([*args, "--max-tokens", "50", "--ctx-size", "20"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    prompt = report["prompt_tokens"]
    assert len(report["tokens"]) <= 20 - prompt
    assert f"at most {20 - prompt} new tokens fit a context of 20 (--ctx-size)" in captured.err
    assert main([*args, "-c", str(prompt)]) == 2  # no room for one new token
    assert "leaves no room" in capsys.readouterr().err
    assert main([*args, "-c", "1000000"]) == 2
    assert "past the model's context" in capsys.readouterr().err


def test_kv_disk_reads_the_blocks_an_earlier_run_wrote_and_answers_the_same(llama_dir, tmp_path, capsys):
    import json

    args = ["generate", "-m", str(llama_dir), "--prompt", "one two three four five six " * 4, "--json",
            "--max-tokens", "6", "--kv-disk", str(tmp_path)]
    reports = []
    for _ in range(2):
        assert main(args) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[0]["tokens_from_disk"] == 0 < reports[1]["tokens_from_disk"]
    assert reports[0]["tokens"] == reports[1]["tokens"] and reports[1]["cache"] == "paged"
    assert main([*args, "--cache", "static"]) == 2
    assert "--kv-disk keeps a paged cache's blocks" in capsys.readouterr().err
