"""The command line: count, memory and lab print what the library computes; errors are clear."""

import json
import subprocess
import sys

import pytest

from kvcache import reference as ref
from kvcache.cli import main
from kvcache.cli._args import int_list

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)


def test_int_list_expands_doubling_and_steps():
    assert int_list("1,2,4,...,256") == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert int_list("10,30,...,70") == [10, 30, 50, 70]
    assert int_list("16,32,...,100") == [16, 32, 64, 100]
    assert int_list("3") == [3]


def test_count_json_rows_are_the_counted_table(capsys):
    assert main(["count", "--d", "4", "--lengths", "1,2,...,8", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["rows"] == ref.mul_table([1, 2, 4, 8], 4)


def test_count_markdown_has_a_row_per_length(capsys):
    assert main(["count", "--d", "2", "--lengths", "1,3"]) == 0
    out = capsys.readouterr().out
    # d=2, n=3: no cache (3·4 + 2·2)·(1+2+3) = 96; cached 3·4·3 + 2·2·(1+2+3) = 60
    assert "| 3 | 96 | 60 | 1.6× | 48 (36 + 12) | 24 (12 + 12) |" in out


def test_count_rejects_non_positive_length(capsys):
    with pytest.raises(SystemExit):
        main(["count", "--lengths", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_memory_from_numbers_and_budget(capsys):
    argv = ["memory", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--tokens", "4096",
            "--batch", "2", "--dtype", "bfloat16", "--budget", "24GiB", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_sequence"] == 512 * 2**20
    assert out["bytes"] == 1024 * 2**20
    assert out["max_sequences_of_tokens"] == 48
    assert out["max_tokens_for_batch"] == 24 * 2**30 // (2 * 131072)


def test_memory_from_config(tmp_path, capsys):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4,
                                  "hidden_size": 64, "sliding_window": 8}))
    assert main(["memory", "--config", str(config), "--tokens", "100", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "sliding window 8" in out
    assert f"{2 * 2 * 4 * 8 * 16 * 4:,} B" in out


def test_memory_counts_a_gguf_files_weights_as_stored_and_refuses_a_folder(tmp_path, capsys):
    """The real SmolLM2 Q4_1 file: its blocks as stored and its norms as float32, fewer bytes than
    the file's own float32 count; a folder has nothing stored to count."""
    from kvcache.defaults import resolve_model_dir

    gguf = str(resolve_model_dir("smollm2"))
    assert main(["memory", "--config", gguf, "--tokens", "8", "--weights", "stored", "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)["weights_bytes"]
    assert main(["memory", "--config", gguf, "--tokens", "8", "--weights", "float32", "--json"]) == 0
    as_float = json.loads(capsys.readouterr().out)["weights_bytes"]
    from pathlib import Path

    assert stored < Path(gguf).stat().st_size < as_float
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}))
    assert main(["memory", "--config", str(config), "--tokens", "8", "--weights", "stored"]) == 2
    assert "--weights stored counts a GGUF file's tensors" in capsys.readouterr().err


def bfloat16_copy(folder, copy) -> str:
    """A copy of checkpoint `folder` with its weights stored in bfloat16."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, copy)
    weights = load_file(copy / "model.safetensors")
    save_file({name: t.to(torch.bfloat16) for name, t in weights.items()}, copy / "model.safetensors")
    return str(copy)


@pytest.mark.parametrize("given", ["smollm2", "gguf file", "bfloat16 folder", "default folder"])
def test_memory_takes_the_model_every_command_takes_in_the_dtype_its_pool_holds(tmp_path, capsys, given):
    """-m as generate, chat and serve take it (a name, a GGUF file, a folder); without --dtype the
    figures are in the dtype load_model holds the model in, which an Engine's pool stores keys and
    values in (float32 for a GGUF, a folder's stored dtype), not an assumed bfloat16."""
    from gguf_files import write_gguf

    from kvcache import load_model
    from kvcache.defaults import default_model_dir
    from kvcache.engine import Engine
    from kvcache.geometry import read_geometry
    from kvcache.memory import KVShape

    model = {"smollm2": "smollm2", "default folder": str(default_model_dir()),
             "gguf file": lambda: str(write_gguf(default_model_dir(), tmp_path / "default.gguf")),
             "bfloat16 folder": lambda: bfloat16_copy(default_model_dir(), tmp_path / "bf16")}
    model = model[given]() if callable(model[given]) else model[given]
    assert main(["memory", "-m", model, "--tokens", "100", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    loaded = load_model(model)
    pool = Engine(loaded, num_blocks=8, block_size=16).pool
    assert figures["dtype"] == pool.model_dtype == ("bfloat16" if given == "bfloat16 folder" else "float32")
    shape = KVShape.from_geometry(read_geometry(loaded.config))
    assert (figures["layers"], figures["kv_heads"], figures["head_dim"]) == (
        shape.layers, shape.kv_heads, shape.head_dim)
    assert figures["bytes_per_sequence"] == shape.bytes(100, 1, figures["dtype"])


def test_memory_of_numbers_alone_is_in_float32_and_a_missing_model_is_named(tmp_path, capsys):
    numbers = ["--layers", "2", "--kv-heads", "2", "--head-dim", "8"]
    assert main(["memory", *numbers, "--tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "float32"
    assert main(["memory", "-m", str(tmp_path / "nowhere"), "--tokens", "8"]) == 2
    assert f"-m {tmp_path / 'nowhere'}: no such file or folder" in capsys.readouterr().err


def test_memory_errors_name_the_missing_arguments(capsys):
    assert main(["memory", "--tokens", "4", "--layers", "2"]) == 2
    assert "missing --kv-heads, --head-dim" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["memory", "--tokens", "4", "--budget", "lots"])
    assert "cannot read size" in capsys.readouterr().err


def test_lab_writes_markdown_and_json(tmp_path, capsys):
    out_file = tmp_path / "lab.md"
    assert main(["lab", "--lengths", "1,2,4", "--tokens", "6", "--out", str(out_file)]) == 0
    printed = capsys.readouterr().out
    assert out_file.read_text() == printed
    assert "## 1. The cache is exact" in printed and "leaves it" in printed
    assert main(["lab", "--lengths", "1,2", "--tokens", "4", "--decimals", "12,1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert all(row["within"] and row["max_abs_diff"] == 0.0 for row in result["equality"])
    assert [r["within"] for r in result["rounding"]["rows"]] == [True, False]


def test_python_dash_m_kvcache_runs_the_cli():
    done = subprocess.run([sys.executable, "-m", "kvcache", "count", "--lengths", "1,2"],
                          capture_output=True, text=True, check=True)
    assert "| 2 |" in done.stdout
    bare = subprocess.run([sys.executable, "-m", "kvcache"], capture_output=True, text=True)
    assert bare.returncode == 2 and "COMMAND" in bare.stderr


def test_count_refuses_absurd_sizes_at_once(capsys):
    assert main(["count", "--lengths", "100000"]) == 2
    assert "past the" in capsys.readouterr().err
    assert main(["count", "--lengths", "1,2,4,8", "--d", "4"]) == 0


def test_version(capsys):
    import kvcache

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"kvcache {kvcache.__version__}"


@pytest.mark.parametrize("dtype, bits", [("int4", 4), ("int8", 8), ("float8_e4m3fn", "fp8")])
def test_memory_of_a_quantized_dtype_is_what_the_quantized_cache_holds(capsys, dtype, bits):
    import torch

    from kvcache.cache import QuantizedCache

    assert main(["memory", "--layers", "3", "--kv-heads", "2", "--head-dim", "32", "--tokens", "300",
                 "--dtype", dtype, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    cache = QuantizedCache(3, bits=bits, group_size=64, residual_length=128)
    for layer in range(3):
        rows = torch.randn(1, 2, 300, 32, dtype=torch.bfloat16)
        cache.update(rows, rows, layer)
    assert figures["bytes_per_sequence"] == cache.nbytes_used
    assert figures["bytes_per_token_packed"] > 3 * 2 * 32 * 2 * (4 if bits == 4 else 8) / 8  # scales count


def test_memory_refuses_quantized_figures_it_cannot_give(capsys):
    assert main(["memory", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--tokens", "8",
                 "--dtype", "float8_e5m2", "--block-size", "4"]) == 2
    assert "stores float8_e4m3fn" in capsys.readouterr().err


@pytest.mark.parametrize("dtype, name, bits", [("int8", "int8", 8), ("int4", "int4", 4),
                                               ("float8_e4m3fn", "fp8", 8)])
def test_memory_counts_a_quantized_paged_pool_with_its_scales_as_the_cache_holds_it(capsys, dtype, name,
                                                                                     bits):
    import torch

    from kvcache.cache import PagedCache

    assert main(["memory", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--tokens", "6", "--dtype",
                 dtype, "--block-size", "4", "--budget", "4096", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    cache = PagedCache(8, 4, num_layers=2, kv_heads=2, head_dim=8, dtype=torch.float32, kv_dtype=dtype)
    for layer in range(2):
        cache.update(torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), layer)
    assert figures["paged_bytes_per_sequence"] == cache.nbytes_used  # two whole blocks, scales included
    assert figures["bytes_per_token"] == 2 * 2 * 2 * (8 * bits // 8 + 4)
    by_dtype = figures["max_paged_sequences_by_kv_dtype"]
    assert by_dtype[name] == figures["max_paged_sequences_of_tokens"] == 4096 // cache.nbytes_used
    assert by_dtype["float32"] < by_dtype["bfloat16"] < by_dtype["int8"] == by_dtype["fp8"] < by_dtype["int4"]


def test_lab_out_pointing_at_a_directory_is_refused_before_any_work(tmp_path, capsys):
    assert main(["lab", "--out", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["lab", "--out", str(tmp_path / "missing" / "lab.md")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_memory_weights_are_the_models_own_and_leave_the_rest_of_the_budget_to_the_cache(capsys, dtype):
    from kvcache import load_model
    from kvcache.defaults import DEFAULT_MODEL_DIR as DEFAULT_MODEL
    from kvcache.memory import KVShape

    model = load_model(DEFAULT_MODEL)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # float32, tied once
    budget = weights + 3_000_000
    argv = ["memory", "--config", str(DEFAULT_MODEL), "--tokens", "500", "--dtype", dtype,
            "--weights", "float32", "--budget", str(budget), "--json"]
    assert main(argv) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["weights_bytes"] == weights
    assert figures["budget_bytes"] == budget and figures["cache_budget_bytes"] == 3_000_000
    if dtype == "float32":
        shape = KVShape.from_config(DEFAULT_MODEL)
        assert figures["max_sequences_of_tokens"] == 3_000_000 // shape.bytes(500, 1, "float32")
    else:
        assert figures["max_sequences_of_tokens"] == 3_000_000 // figures["bytes_per_sequence"]


def test_memory_weights_that_fill_the_budget_or_lack_a_config_are_refused(capsys):
    from kvcache.defaults import DEFAULT_MODEL_DIR as DEFAULT_MODEL

    assert main(["memory", "--config", str(DEFAULT_MODEL), "--tokens", "8", "--weights", "bfloat16",
                 "--budget", "1MiB"]) == 1
    assert "weights alone" in capsys.readouterr().err
    assert main(["memory", "--layers", "2", "--kv-heads", "2", "--head-dim", "8", "--tokens", "8",
                 "--weights", "bfloat16"]) == 2
    assert "--weights needs -m" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--layers", "--kv-heads", "--head-dim", "--window"])
def test_memory_refuses_a_shape_past_the_bounds_a_config_is_held_to(capsys, flag):
    from kvcache.geometry import SIZE_LIMITS

    numbers = {"--layers": "2", "--kv-heads": "2", "--head-dim": "8"}
    numbers[flag] = str(max(SIZE_LIMITS.values()) + 1)
    argv = ["memory", "--tokens", "8", *[part for pair in numbers.items() for part in pair]]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} " in err and "past the largest" in err


def test_memory_from_a_config_dict_of_each_window_rule_is_the_allocation(tmp_path, capsys):
    """The command reads a qwen2 config's max_window_layers and a llama config's unused
    sliding_window as the model does: its bytes are the cache's after that many tokens."""
    import torch

    from kvcache.model import LlamaForCausalLM, ModelConfig

    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    for extra in (dict(model_type="llama", sliding_window=8),
                  dict(model_type="qwen2", sliding_window=8, use_sliding_window=True, max_window_layers=2)):
        raw = {**base, **extra}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        argv = ["memory", "--config", str(tmp_path), "--tokens", "20", "--dtype", "float32", "--json"]
        assert main(argv) == 0
        printed = json.loads(capsys.readouterr().out)
        model = LlamaForCausalLM(ModelConfig.from_dict(raw)).eval()
        with torch.no_grad():
            cache = model(torch.randint(0, 64, (1, 20))).past_key_values
        assert printed["bytes"] == cache.nbytes_used, extra


def test_the_command_ends_without_the_interpreters_teardown_and_keeps_its_output():
    """The console script exits at once after the command (the teardown of torch and the kernels'
    thread pools took about a second after serve's "stopped"), its output flushed, its status kept."""
    script = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
        "sys.argv = ['kvcache', 'count', '--lengths', '4', '--json']\n"
        "from kvcache.cli import console_main\n"
        "console_main()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "teardown ran" not in done.stderr
    assert json.loads(done.stdout)  # printed, and flushed before the end
    script = script.replace("'--lengths', '4'", "'--lengths', '-4'")
    failed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert failed.returncode == 2 and "teardown ran" not in failed.stderr


@pytest.mark.parametrize("command", ["generate", "serve", "chat"])
def test_the_help_of_a_command_that_runs_a_model_says_why_weights_are_held_twice(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "held twice" in " ".join(capsys.readouterr().out.split())


def kv_flags():
    """A parser of the KV cache flags the model-running commands share."""
    import argparse

    from kvcache.cli._args import add_kv_cache_dtype

    parser = argparse.ArgumentParser()
    add_kv_cache_dtype(parser)
    return parser


@pytest.mark.parametrize("flags, expected", [
    ([], None),
    (["--kv-cache-dtype", "int8"], "int8"),
    (["--kv-k-dtype", "int8", "--kv-v-dtype", "int4"], "int8/int4"),
    (["--kv-cache-dtype", "int4", "--kv-k-dtype", "int8"], "int8/int4"),
    (["--kv-v-dtype", "int4"], ValueError),
    (["--kv-cache-dtype", "fp8"], "fp8"),
    (["--kv-k-dtype", "bfloat16", "--kv-v-dtype", "int4"], "bfloat16/int4"),
    (["--kv-cache-dtype", "float16", "--kv-v-dtype", "float16"], "float16"),
])
def test_the_kv_dtype_flags_name_one_packing_of_keys_and_values(flags, expected):
    from kvcache.cli._args import kv_dtype_of

    args = kv_flags().parse_args(flags)
    if expected is ValueError:
        with pytest.raises(ValueError, match="--kv-v-dtype sets one of keys and values apart"):
            kv_dtype_of(args)
    else:
        assert kv_dtype_of(args) == expected


@pytest.mark.parametrize("flags, expected", [
    ([], 0),
    (["--kv-cache-dtype", "int4", "--kv-window", "32"], 32),
    (["--kv-window", "32"], ValueError),
    (["--kv-cache-dtype", "int8", "--kv-window", "-1"], SystemExit),
])
def test_the_kv_window_flag_needs_a_kv_dtype_and_a_count(flags, expected, capsys):
    from kvcache.cli._args import kv_window_of

    parser = kv_flags()
    if expected is SystemExit:
        with pytest.raises(SystemExit):
            parser.parse_args(flags)
        assert "--kv-window" in capsys.readouterr().err
        return
    args = parser.parse_args(flags)
    if expected is ValueError:
        with pytest.raises(ValueError, match="--kv-window 32 keeps recent tokens"):
            kv_window_of(args)
    else:
        assert kv_window_of(args) == expected


def test_generate_with_a_kv_window_wider_than_the_run_answers_as_a_float_paged_cache(capsys):
    found = []
    for flags in (["--cache", "paged"], ["--kv-cache-dtype", "int4", "--kv-window", "128"]):
        run = ["generate", "--prompt", "Once upon a time", "--max-new-tokens", "24", "--json", *flags]
        assert main(run) == 0
        reply = json.loads(capsys.readouterr().out)
        found.append(reply["tokens"])
    assert found[0] == found[1] and reply["kv_window"] == 128


def test_generate_on_a_gguf_reads_q8_activations_by_default_and_float32_when_asked(capsys):
    """A GGUF's blocks read activations rounded to 8 bits by default (the weights line says so,
    the block step runs); --activations float32 reads them exact (the line does not say it);
    --activations q8 with --dtype (every weight dequantized) is refused naming both."""
    run = ["generate", "-m", "smollm2", "--prompt", "Once upon a time", "--max-new-tokens", "6", "--json"]
    assert main(run) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["decode_step"] == "blocks"
    assert "activations rounded to 8 bits as llama.cpp's" in captured.err
    assert main([*run, "--activations", "float32"]) == 0
    assert "activations rounded to 8 bits" not in capsys.readouterr().err
    assert main([*run, "--activations", "q8", "--dtype", "float32"]) == 2
    assert "--activations q8" in capsys.readouterr().err
    assert main([*run, "--dtype", "float32"]) == 0  # (auto: float32 where every weight is dequantized)


def test_generate_speculates_with_the_same_tokens_and_says_what_its_drafts_gave(capsys):
    """--speculate ngram on a GGUF (q8: the exact blocks step): the tokens equal the no-cache
    run's (--compare-nocache), the summary and the report count the drafts; on the bundled
    float32 model, whose many-token steps sum in another order, it is refused by name."""
    prompt = "Repeat exactly: red green blue, red green blue, red green blue."
    run = ["generate", "-m", "smollm2", "--chat", prompt, "--max-new-tokens", "16", "--speculate", "ngram"]
    assert main([*run, "--compare-nocache"]) == 0
    err = capsys.readouterr().err
    assert "tokens identical to the no-cache run: yes" in err and "speculate ngram:" in err
    assert main([*run, "--json", "--draft-tokens", "4"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["speculate"] == "ngram" and reply["drafted_tokens"] >= reply["accepted_tokens"] > 0
    assert main(["generate", "--prompt", "hi", "--speculate", "ngram"]) == 2
    assert "speculate needs a backend" in capsys.readouterr().err
