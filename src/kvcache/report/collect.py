"""Gather every figure of the report into one JSON-ready dict (`collect_report`).

Counted parts first (standard library), then the engine on the model (torch, imported here only
when those parts run). `progress(fraction, label)` is called as it goes: fraction of the whole
run done in [0, 1], and what it is doing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvcache.report.counted import count_figures, memory_figures, rounding_figures
from kvcache.report.machine import load_average, machine_figures
from kvcache.report.settings import ReportSettings

Progress = Callable[[float, str], None]

SCHEMA_VERSION = 1

# Share of the run's time each part takes (roughly, on the default model), for the progress bar.
_WEIGHTS = {"counts": 0.05, "rounding": 0.02, "model": 0.05, "memory": 0.01, "latency": 0.35,
            "equality": 0.2, "drift": 0.32}


class _Stages:
    """Turns a part's own progress (0..1) into the whole run's."""

    def __init__(self, progress: Progress | None):
        self.progress = progress or (lambda fraction, label: None)
        self.done = 0.0

    def part(self, name: str) -> Progress:
        start, width = self.done, _WEIGHTS[name]
        self.done += width
        return lambda fraction, label: self.progress(min(1.0, start + width * fraction), label)


def _prompts(folder: Path, vocab_size: int, count: int, seed: int) -> tuple[list[list[int]], str]:
    """Token ids of the report's prompts through the model's tokenizer (a folder's tokenizer.json,
    the one a GGUF file carries), or (a folder without tokenizer.json) seeded random ids of 160
    tokens each."""
    from kvcache.defaults import is_gguf
    from kvcache.report.measured import PROMPTS

    if is_gguf(folder) or (folder / "tokenizer.json").is_file():
        from kvcache.text.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(folder)
        return [tokenizer.encode(text) for text in PROMPTS[:count]], "text"
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(160)] for _ in range(count)], "random ids"


def collect_report(settings: ReportSettings, model_dir: str | Path | None = None,
                   progress: Progress | None = None) -> dict:
    """Every figure of the report as a JSON-ready dict (see docs/report.md for the keys).

    model_dir: what every command's -m takes (a checkpoint folder, a GGUF file, a name of
    `kvcache.defaults.KNOWN_MODELS`); None uses kvcache's bundled default model.
    """
    from kvcache.defaults import resolve_model_dir

    folder = Path(resolve_model_dir(model_dir))
    stages = _Stages(progress)
    started = time.perf_counter()
    load_before = load_average()
    report: dict = {"schema": SCHEMA_VERSION, "settings": settings.to_dict(),
                    "model": str(model_dir) if model_dir is not None else "bundled default model"}

    say = stages.part("counts")
    say(0.0, "counts: counting multiplications")
    report["counts"] = count_figures(settings.count_lengths, settings.count_d, settings.seed)
    say = stages.part("rounding")
    say(0.0, "drift: reference rounding")
    rounding = rounding_figures(settings.rounding_bits, settings.rounding_tokens, settings.count_d,
                                settings.seed)
    say = stages.part("model")
    say(0.0, f"loading {folder.name}")
    from kvcache.geometry import read_geometry
    from kvcache.memory import KVShape
    from kvcache.model import load_model
    from kvcache.report import measured

    model = load_model(folder)
    say = stages.part("memory")
    say(0.0, "memory: bytes and capacity")
    shape = KVShape.from_geometry(read_geometry(model.config, folder.name))  # as the engine's pool reads it
    report["memory"] = memory_figures(shape, folder.name, settings.memory_lengths, settings.memory_dtypes,
                                      settings.budget_bytes, settings.capacity_tokens)
    prompts, source = _prompts(folder, model.config.vocab_size, settings.drift_prompts, settings.seed)
    report["model_config"] = {
        "name": folder.name, "model_type": model.config.model_type, "layers": model.config.num_hidden_layers,
        "hidden_size": model.config.hidden_size, "heads": model.config.num_attention_heads,
        "kv_heads": model.config.num_key_value_heads, "head_dim": model.config.head_dim,
        "vocab_size": model.config.vocab_size, "dtype": str(model.dtype),
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": model.config.max_position_embeddings,
    }
    report["latency"] = measured.latency_figures(model, settings.latency_lengths, settings.latency_repeats,
                                                 settings.seed, stages.part("latency"))
    report["equality"] = measured.equality_figures(
        model, prompts[0], settings.equality_new_tokens, settings.equality_window,
        settings.equality_block_size, stages.part("equality"))
    engine = measured.drift_figures(model, prompts, settings.drift_bits, settings.drift_tokens,
                                    settings.drift_group_size, settings.drift_residual,
                                    stages.part("drift"))
    engine["prompt_source"] = source
    report["drift"] = {"reference": rounding, "engine": engine}
    report["machine"] = machine_figures()
    report["machine"]["load_average_before"] = load_before
    report["elapsed_s"] = time.perf_counter() - started  # write_report adds the plots' time
    return report
