"""`kvcache report --quick` end to end on the default model: every figure in report.json has its
keys and sane values (counts equal the closed forms, exact caches within tolerance, drift and
memory consistent with the library), and the PNGs are real images."""

import contextlib
import io
import json
import subprocess
import sys

import pytest

from kvcache.cli import main
from kvcache.memory import KVShape, max_sequences
from kvcache.reference import formulas, mul_table
from kvcache.report import PLOTS

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        status = main(["report", "--quick", "--out", str(out)])
    report = json.loads((out / "report.json").read_text(encoding="utf-8"))
    return {"status": status, "out": out, "report": report, "stdout": stdout.getvalue(),
            "stderr": stderr.getvalue()}


def test_report_quick_exits_zero_with_progress_on_stderr_and_files_on_stdout(run):
    assert run["status"] == 0
    assert "kvcache report [" in run["stderr"] and "100%" in run["stderr"]
    assert "wrote report.md, report.json" in run["stdout"]
    assert run["report"]["settings"]["quick"] is True
    assert run["report"]["elapsed_s"] < 60


def test_every_plot_is_a_png_that_matplotlib_reads_back(run):
    from matplotlib.image import imread

    assert set(run["report"]["plots"]) == set(PLOTS)
    for name in run["report"]["plots"].values():
        path = run["out"] / name
        assert path.read_bytes()[:8] == PNG_SIGNATURE, name
        pixels = imread(path)
        assert pixels.ndim == 3 and pixels.shape[2] in (3, 4), (name, pixels.shape)
        assert pixels.shape[0] >= 200 and pixels.shape[1] >= 400, (name, pixels.shape)
        assert pixels.std() > 0.05, f"{name} is blank"
        assert path.stat().st_size < 400_000, f"{name} is too large"


def test_markdown_has_every_section_and_links_every_plot(run):
    text = (run["out"] / "report.md").read_text(encoding="utf-8")
    for number in range(1, 7):
        assert f"\n## {number}. " in text
    for name in run["report"]["plots"].values():
        assert f"]({name})" in text
    assert "**NO**" not in text.split("## 4.")[0], "a counted or equality row failed"


def test_counts_equal_the_closed_forms_and_the_counted_table(run):
    counts = run["report"]["counts"]
    d = counts["d"]
    lengths = [row["length"] for row in counts["rows"]]
    assert lengths == run["report"]["settings"]["count_lengths"]
    assert counts["rows"] == mul_table(lengths, d)
    assert counts["matches_closed_forms"] is True
    for row in counts["rows"]:
        n = row["length"]
        assert row["nocache_per_token"] == formulas.single_head_nocache_step(n, d)
        assert row["cached_per_token"] == formulas.single_head_cached_step(n, d)
        assert row["nocache_total"] == formulas.single_head_nocache_total(n, d)
        assert row["cached_total"] == formulas.single_head_cached_total(n, d)
        assert row["cached_projection_per_token"] == 3 * d * d  # constant: what the cache removes
        assert row["cached_attention_per_token"] == row["nocache_attention_per_token"] == 2 * n * d


def test_latency_rows_have_medians_inside_their_spread(run):
    latency = run["report"]["latency"]
    assert latency["threads"] == 1
    assert [r["context"] for r in latency["rows"]] == run["report"]["settings"]["latency_lengths"]
    for row in latency["rows"]:
        for key in ("cached_ms", "uncached_ms"):
            spread = row[key]
            assert len(spread["samples"]) == latency["repeats"]
            assert 0 < spread["min"] <= spread["median"] <= spread["max"] < 10_000
        assert row["speedup"] == pytest.approx(row["uncached_ms"]["median"] / row["cached_ms"]["median"])
    assert latency["rows"][-1]["speedup"] > 1  # 256 positions recomputed vs one


def test_every_exact_cache_kind_is_within_tolerance(run):
    equality = run["report"]["equality"]
    tol = equality["tolerance"]
    kinds = {row["kind"] for row in equality["rows"]}
    assert kinds == {"dynamic", "static", "paged", "sliding", "dynamic, windowed layers"}
    assert equality["prompt_tokens"] > 32 + 2 * 16  # the prompt alone crosses the window and blocks
    for row in equality["rows"]:
        assert "skipped" not in row, row
        assert row["within"] and row["same_argmax"], row
        assert 0 <= row["tolerance_used"] <= 1, row
        assert 0 <= row["max_abs_logit_diff"] <= tol["atol"] + tol["rtol"] * row["max_abs_logit"], row
        assert row["max_abs_logit"] > 1


def test_reference_drift_shrinks_with_bits_and_engine_drift_is_against_tolerance(run):
    ref = run["report"]["drift"]["reference"]
    diffs = [row["max_abs_diff"] for row in ref["rows"]]
    assert [row["bits"] for row in ref["rows"]] == sorted(run["report"]["settings"]["rounding_bits"])
    assert all(a > b for a, b in zip(diffs, diffs[1:])), diffs
    assert ref["rows"][-1]["within"] and not ref["rows"][0]["within"]

    engine = run["report"]["drift"]["engine"]
    rows = {row["name"]: row for row in engine["rows"]}
    assert set(rows) == {"int8", "int4", "fp8"}
    tol = engine["tolerance"]
    for row in rows.values():
        assert 0 <= row["mean_kl"] <= row["max_kl"]
        assert 0 <= row["greedy_agreement"] <= 1 and 0 <= row["teacher_forced_agreement"] <= 1
        assert row["max_abs_logit_diff"] > 0
        assert row["quantized_fraction"] > 0.5  # most of the cache is packed, so drift is measured
        assert row["bytes_per_token"] < row["reference_bytes_per_token"]
        assert row["within_tolerance"] == (
            row["greedy_agreement"] >= tol["greedy_agreement"]
            and row["teacher_forced_agreement"] >= tol["teacher_forced_agreement"]
            and row["mean_kl"] <= tol["mean_kl"])
    assert rows["int8"]["mean_kl"] < rows["int4"]["mean_kl"]
    assert rows["int8"]["within_tolerance"]


def test_memory_figures_equal_the_planner(run):
    memory = run["report"]["memory"]
    names = [m["name"] for m in memory["models"]]
    assert names == ["default_model", "Llama-2-7B", "Llama-3-8B", "Mistral-7B-v0.1", "Qwen2-7B"]
    by_name = {m["name"]: m for m in memory["models"]}
    # layers / kv heads / head dim from the published config.json fields
    assert [(by_name[n]["layers"], by_name[n]["kv_heads"], by_name[n]["head_dim"]) for n in names[1:]] == [
        (32, 32, 128), (32, 8, 128), (32, 8, 128), (28, 4, 128)]
    assert (by_name["default_model"]["layers"], by_name["default_model"]["kv_heads"]) == (4, 4)
    assert by_name["Llama-3-8B"]["bytes_per_token"]["bfloat16"] == 2 * 32 * 8 * 128 * 2
    assert by_name["Mistral-7B-v0.1"]["sliding_window"] == 4096
    assert by_name["Qwen2-7B"]["sliding_window"] is None  # use_sliding_window: false
    for model in memory["models"]:
        window = model["sliding_window"]
        shape = KVShape(model["layers"], model["kv_heads"], model["head_dim"], window,
                        ("sliding_attention",) * model["layers"] if window else None)
        for row in model["rows"]:
            for dtype in memory["dtypes"]:
                assert row[dtype] == shape.bytes(row["tokens"], 1, dtype)
        for dtype in memory["dtypes"]:
            assert model["capacity"][dtype]["max_sequences"] == max_sequences(
                shape, memory["budget_bytes"], memory["capacity_tokens"], dtype)
    mistral = {r["tokens"]: r["bfloat16"] for r in by_name["Mistral-7B-v0.1"]["rows"]}
    llama3 = {r["tokens"]: r["bfloat16"] for r in by_name["Llama-3-8B"]["rows"]}
    assert mistral[8192] == mistral[4096] == llama3[4096] < llama3[8192]  # the window caps it
    assert by_name["Mistral-7B-v0.1"]["capacity"]["bfloat16"]["max_tokens_batch_1"] is None


def test_machine_and_versions_are_recorded(run):
    machine = run["report"]["machine"]
    for key in ("platform", "cpu", "cpu_count", "python", "torch", "torch_threads", "matplotlib", "kvcache"):
        assert machine.get(key) not in (None, ""), key
    assert machine["python"] == ".".join(map(str, sys.version_info[:3]))


def test_a_model_with_sliding_layers_gets_a_report_with_every_cache_kind_exact(tmp_path):
    """The default checkpoint relabelled as a Mistral with a 16-token window: the latency crop
    keeps working on its rings, the paged cache (full attention only) is a skipped row."""
    import shutil

    from kvcache.backends import torch_threads
    from kvcache.defaults import default_model_dir
    from kvcache.report.collect import collect_report
    from kvcache.report.render import report_markdown
    from kvcache.report.settings import ReportSettings

    folder = tmp_path / "windowed"
    shutil.copytree(default_model_dir(), folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=16)
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")

    settings = ReportSettings.for_run(True, latency_lengths=(16, 48), latency_repeats=1,
                                      equality_new_tokens=8, drift_bits=(8,), drift_tokens=4,
                                      count_lengths=(1, 2))
    with torch_threads(1):
        report = collect_report(settings, folder)
    rows = {row["kind"]: row for row in report["equality"]["rows"]}
    assert rows["sliding"]["window"] == 16
    for kind in ("dynamic", "static", "paged", "sliding", "dynamic, windowed layers"):  # paged: its window
        assert "skipped" not in rows[kind] and rows[kind]["max_abs_logit_diff"] < 1e-3, rows[kind]
    assert report["memory"]["models"][0]["sliding_window"] == 16
    drift = report["drift"]["engine"]["rows"][0]
    assert drift["quantized_fraction"] == 0  # rings stay full precision: nothing measured
    assert drift["within_tolerance"] is False
    report["elapsed_s"] = 0.0
    markdown = report_markdown(report, {})
    assert "skipped" not in markdown and "**nothing quantized**" in markdown


@pytest.mark.processes
def test_importing_the_report_package_and_command_imports_neither_torch_nor_matplotlib():
    code = ("import sys, kvcache.report, kvcache.report.counted, kvcache.cli.report;"
            "assert 'torch' not in sys.modules, 'torch imported';"
            "assert 'matplotlib' not in sys.modules, 'matplotlib imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_command_exits_1_naming_an_exact_cache_out_of_tolerance(run, monkeypatch, tmp_path, capsys):
    """The record is written whatever it holds; an exact cache out of tolerance (a wrong answer)
    makes the exit status 1."""
    import copy

    import kvcache.report

    broken = copy.deepcopy(run["report"])
    row = next(r for r in broken["equality"]["rows"] if "skipped" not in r)
    row["within"] = False
    broken["drift"]["engine"]["rows"][0].update(within_tolerance=False, quantized_fraction=0.0)
    monkeypatch.setattr(kvcache.report, "write_report", lambda *args, **kwargs: broken)
    assert main(["report", "--quick", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"exact caches not within tolerance: equality {row['kind']}" in err
    assert f"drift {broken['drift']['engine']['rows'][0]['name']} (nothing quantized)" in err
    assert run["status"] == 0  # the real run, every row within


def test_the_command_with_no_arguments_reports_on_the_default_model_and_exits_0_past_a_drift_tolerance(
        run, monkeypatch, tmp_path, capsys):
    """`kvcache report` alone: the full run on the bundled default model into ./report; the lossy
    caches' drift past its tolerance (the default run's int4 and fp8 diverge late on a prompt) is
    measured and said, not an exit status of 1."""
    import copy

    import kvcache.report

    drifted = copy.deepcopy(run["report"])
    for row in drifted["drift"]["engine"]["rows"]:
        row.update(within_tolerance=False, greedy_agreement=0.96875)
    asked = {}

    def recorded(out, model_dir, quick, **options):
        asked.update(out=out, model=model_dir, quick=quick)
        return drifted

    monkeypatch.setattr(kvcache.report, "write_report", recorded)
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 0
    assert asked == {"out": "report", "model": None, "quick": False}
    captured = capsys.readouterr()
    assert "wrote report.md" in captured.out
    names = ", ".join(f"drift {row['name']}" for row in drifted["drift"]["engine"]["rows"])
    assert f"past their drift tolerance (measured, shown in report.md section 4; not a failure): {names}" \
        in captured.err


def test_exact_caches_are_held_to_a_tolerance_scaled_by_the_logits(tmp_path):
    """Logits a thousand times larger round a thousand times coarser: the exact caches differ
    from the no-cache path by more than the bare absolute tolerance and still pass."""
    import torch
    from tiny_models import tiny_model

    from kvcache.report.measured import EQUALITY_ATOL, equality_figures

    model = tiny_model(seed=3, layers=2)
    with torch.no_grad():
        model.lm_head.weight.mul_(1e4)
    figures = equality_figures(model, list(range(3, 20)), new_tokens=6, window=4, block_size=4)
    rows = [r for r in figures["rows"] if "skipped" not in r]
    assert rows and all(r["within"] for r in rows)
    assert max(r["max_abs_logit_diff"] for r in rows) > EQUALITY_ATOL  # a bare atol would fail


@pytest.fixture(scope="module")
def default_gguf(tmp_path_factory):
    """The bundled default model converted to a GGUF file (tests/gguf_files.py)."""
    from gguf_files import write_gguf

    from kvcache.defaults import default_model_dir

    return write_gguf(default_model_dir(), tmp_path_factory.mktemp("gguf") / "default_model.gguf")


@pytest.mark.parametrize("given", ["smollm2", "gguf file"])
def test_the_command_takes_the_model_every_command_takes(run, monkeypatch, tmp_path, capsys, given,
                                                         default_gguf):
    """-m as generate, chat and serve take it: a name of a packaged model or a GGUF file, not only
    a folder holding config.json."""
    import kvcache.report

    model = str(default_gguf) if given == "gguf file" else given
    asked = {}

    def recorded(out, model_dir, **options):
        asked["model"] = model_dir
        return run["report"]

    monkeypatch.setattr(kvcache.report, "write_report", recorded)
    assert main(["report", "-m", model, "--quick", "--out", str(tmp_path)]) == 0, capsys.readouterr().err
    assert asked["model"] == model


def test_a_missing_model_is_refused_naming_the_flag_before_anything_is_measured(tmp_path, capsys):
    assert main(["report", "-m", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "-m " in err and "no such file or folder" in err and "kvcache report [" not in err


def test_a_report_on_a_gguf_file_reads_its_geometry_and_tokenizer(default_gguf):
    """A GGUF file has no config.json: the memory figures come from its metadata (as the engine
    reads the loaded model's config) and the prompts through the tokenizer it carries."""
    from kvcache.backends import torch_threads
    from kvcache.report.collect import collect_report
    from kvcache.report.settings import ReportSettings

    settings = ReportSettings.for_run(True, latency_lengths=(16,), latency_repeats=1, equality_new_tokens=4,
                                      drift_bits=(8,), drift_tokens=4, count_lengths=(1, 2))
    with torch_threads(1):
        report = collect_report(settings, default_gguf)
    model = report["memory"]["models"][0]
    assert model["name"] == "default_model.gguf"
    assert (model["layers"], model["kv_heads"], model["head_dim"]) == (4, 4, 32)
    assert report["drift"]["engine"]["prompt_source"] == "text"
