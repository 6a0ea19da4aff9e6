"""kvcache.report.drift and `kvcache drift`: drift of quantized caches against the unquantized cache."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from tiny_models import llama_checkpoint

from kvcache.cli import main
from kvcache.cli.drift import bits_list
from kvcache.model import load_model
from kvcache.report.drift import DriftSetting, Tolerance, default_model_dir, drift_table, measure_drift

JSON_KEYS = {"bits", "kind", "max_abs_logit_diff", "mean_kl", "greedy_agreement", "bytes_per_token",
             "within_tolerance", "teacher_forced_agreement", "first_divergence", "quantized_fraction"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, one_thread):
    """A random 2-layer Llama saved by transformers, with the test tokenizer."""
    return llama_checkpoint(
        tmp_path_factory.mktemp("drift_llama"), seed=11, hidden_size=64, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, num_hidden_layers=2, vocab_size=300,
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return load_model(tiny_dir)


def prompts(count: int = 2, length: int = 12):
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, 300, (length,), generator=generator) for _ in range(count)]


def test_a_residual_that_holds_everything_gives_zero_drift(tiny):
    setting = DriftSetting(4, group_size=8, residual_length=64)
    (result,) = measure_drift(tiny, prompts(), [setting], tokens=16)
    assert result.max_abs_logit_diff == 0 and result.mean_kl == 0
    assert result.greedy_agreement == result.teacher_forced_agreement == 1.0
    assert result.first_divergence == [None, None] and result.quantized_fraction == 0
    assert result.cache_bytes == result.reference_cache_bytes
    assert not result.within_tolerance  # it measured nothing: not a pass
    assert "nothing quantized" in drift_table([result])


def test_drift_figures_are_consistent_and_ordered_by_precision(tiny):
    settings = [DriftSetting(8, 8, 0), DriftSetting(4, 8, 0), DriftSetting("fp8", 8, 0)]
    results = measure_drift(tiny, prompts(), settings, tokens=24)
    int8, int4, fp8 = results
    for result in results:
        assert result.quantized_fraction > 0.8
        assert 0 < result.max_abs_logit_diff and 0 < result.mean_kl <= result.max_kl
        assert 0 <= result.greedy_agreement <= 1 and 0 <= result.teacher_forced_agreement <= 1
        for first in result.first_divergence:
            assert first is None or 0 <= first < 24
        if result.first_divergence == [None, None]:
            assert result.greedy_agreement == 1.0
        assert result.cache_bytes < result.reference_cache_bytes
        assert result.bytes_per_token < result.reference_bytes_per_token
    assert int8.mean_kl < fp8.mean_kl < int4.mean_kl
    assert int8.max_abs_logit_diff < int4.max_abs_logit_diff
    # per token, 2 layers × 2 kv heads: int8 codes 2·2·(16 + 16) = 128 B; key scale and zero
    # point (fp32) per channel per 8 tokens 2·2·16·8 / 8 = 64 B; value scale and zero point per
    # 8 channels 2·2·2·8 = 64 B. int4 halves the codes, fp8 halves the scales (no zero point).
    assert (int8.bytes_per_token, int4.bytes_per_token, fp8.bytes_per_token) == (256, 192, 192)
    assert int8.reference_bytes_per_token == 2 * 2 * 2 * 16 * 4
    table = drift_table(results)
    assert "int8 g8 r0" in table and "fp8 g8 r0" in table and table.count("\n") == 4


def test_within_tolerance_follows_the_stated_tolerance(tiny):
    (result,) = measure_drift(tiny, prompts(1), [DriftSetting(4, 8, 0)], tokens=8)
    result.tolerance = Tolerance(greedy_agreement=0.0, teacher_forced_agreement=0.0, mean_kl=1.0)
    assert result.within_tolerance
    result.tolerance = Tolerance(mean_kl=0.0)
    assert not result.within_tolerance


def test_the_cli_prints_one_json_object_per_setting(tiny_dir, capsys):
    status = main(["drift", "--model", str(tiny_dir), "--bits", "8,fp8", "--tokens", "6",
                   "--group-size", "4", "--residual", "0", "--json"])
    captured = capsys.readouterr()
    assert status == 0
    rows = [json.loads(line) for line in captured.out.splitlines()]
    assert [(row["bits"], row["kind"]) for row in rows] == [(8, "int"), (8, "fp8")]
    assert all(JSON_KEYS <= set(row) for row in rows)
    assert "prompt 3/3" in captured.err  # progress on stderr, three built-in text prompts


def test_the_cli_markdown_table_states_the_tolerance(tiny_dir, capsys):
    status = main(["drift", "--model", str(tiny_dir), "--bits", "4", "--tokens", "4",
                   "--prompt", "for x in", "--max-kl", "0.5"])
    captured = capsys.readouterr()
    out = captured.out
    assert status == 1  # 4 tokens stay in a residual of 32: nothing was measured, which fails
    assert "| int4 g32 r32 |" in out and "mean KL <= 0.5 nats" in out and "1 prompts (text)" in out
    assert "nothing quantized" in out and "lower --residual" in captured.err


def test_the_cli_exits_1_when_a_row_is_out_of_tolerance(tiny_dir, capsys):
    arguments = ["drift", "--model", str(tiny_dir), "--bits", "4", "--tokens", "8", "--group-size", "4",
                 "--residual", "0", "--prompt", "for x in"]
    assert main([*arguments, "--max-kl", "0"]) == 1
    assert "not within tolerance" in capsys.readouterr().err
    assert main([*arguments, "--max-kl", "10", "--min-agreement", "0"]) == 0


def test_the_cli_without_the_default_model_asks_for_one(monkeypatch, tmp_path, capsys):
    import kvcache.report.drift

    monkeypatch.setattr(kvcache.report.drift, "default_model_dir", lambda: tmp_path / "absent")
    assert main(["drift"]) == 2
    assert "pass --model DIR" in capsys.readouterr().err


def test_bits_list_reads_8_4_and_fp8():
    assert bits_list("8, 4,FP8") == [8, 4, "fp8"]
    with pytest.raises(argparse.ArgumentTypeError, match="8, 4 or fp8"):
        bits_list("8,2")


def test_int8_on_the_default_model_agrees_on_at_least_99_percent_of_128_greedy_tokens(one_thread):
    from kvcache.report.drift import DEFAULT_PROMPTS
    from kvcache.text.tokenizer import load_tokenizer

    folder = default_model_dir()
    model = load_model(folder)
    tokenizer = load_tokenizer(folder)
    ids = [torch.tensor(tokenizer.encode(text)) for text in DEFAULT_PROMPTS]
    (result,) = measure_drift(model, ids, [DriftSetting(8)], tokens=128)
    assert result.quantized_fraction > 0.5
    assert result.greedy_agreement >= 0.99, result.to_dict()
    assert result.teacher_forced_agreement >= 0.99 and result.within_tolerance


def test_the_cli_takes_a_gguf_file_and_a_model_name_as_every_command_does(
    tiny_dir, tmp_path, monkeypatch, capsys
):
    """-m as generate, chat and serve take it: a GGUF file (its own tokenizer encodes --prompt) and
    a name of `kvcache.defaults.KNOWN_MODELS`, not only a checkpoint folder."""
    from gguf_files import write_gguf

    import kvcache.defaults

    gguf = write_gguf(tiny_dir, tmp_path / "tiny.gguf")
    arguments = ["--bits", "8", "--tokens", "4", "--group-size", "4", "--residual", "0", "--json",
                 "--prompt", "for x in"]
    assert main(["drift", "-m", str(gguf), *arguments]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[0])["bits"] == 8
    monkeypatch.setattr(kvcache.defaults, "resolve_model_dir",
                        lambda path: gguf if path == "smollm2" else path)
    assert main(["drift", "-m", "smollm2", *arguments]) == 0, capsys.readouterr().err
