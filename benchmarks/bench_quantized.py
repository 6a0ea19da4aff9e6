"""Bytes per token and decode speed of fp32 / bf16 / int8 / int4 / fp8 KV caches on a ~100M
random Llama at 512 and 4096 tokens of context.

The model (hidden 768, 12 layers, 12 heads, 4 kv heads, intermediate 2048, vocab 32000, random
weights) is built by transformers, saved, and loaded with kvcache.load_model. One prefill of
the longest context fills an unquantized cache; for each context L and each kind a fresh cache
is then given the first L keys/values of every layer in one update (a bf16 cache gets them in
bf16 and runs the bf16 copy of the model; the quantized caches run the fp32 model, with the
default group 64 and 128-token residual), and `steps` single-token decode steps are timed one
by one after `warmup` untimed ones. Kinds take turns within each of `rounds` rounds; the table
gives each kind's median step over all rounds (warm figures: a first untimed round pays page
faults). Bytes per token is the cache's `nbytes_used` / L (the residual included) and the
packed steady state from `kvcache.memory.quantized_kv_cache_bytes`.

    .venv/bin/python benchmarks/bench_quantized.py                 # 512 and 4096
    .venv/bin/python benchmarks/bench_quantized.py --quick         # a 4-layer model, 256 and 1024

Writes benchmarks/results/quantized.json and .md (or --out PREFIX).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from kvcache import load_model, make_cache
from kvcache.memory import kv_cache_bytes, quantized_kv_cache_bytes

RESULTS = Path(__file__).parent / "results"
KINDS = ("fp32", "bf16", "int8", "int4", "fp8")
BITS = {"int8": 8, "int4": 4, "fp8": "fp8"}
GROUP, RESIDUAL = 64, 128


def build_model(folder: Path, args: argparse.Namespace):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=768, num_hidden_layers=args.layers, num_attention_heads=12, num_key_value_heads=4,
        intermediate_size=2048, vocab_size=32000, max_position_embeddings=8192,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return load_model(folder), load_model(folder, dtype="bfloat16")


def make(kind: str, model, context_keys, context_values, length: int):
    """A cache of `kind` holding the first `length` tokens of the prefilled keys/values."""
    if kind in BITS:
        cache = make_cache("quantized", config=model.config, bits=BITS[kind], group_size=GROUP,
                           residual_length=RESIDUAL)
    else:
        cache = make_cache("dynamic", config=model.config)
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    for layer, (keys, values) in enumerate(zip(context_keys, context_values)):
        cache.update(keys[:, :, :length].to(dtype), values[:, :, :length].to(dtype), layer)
    return cache


def time_steps(model, cache, steps: int, warmup: int) -> list[float]:
    token = torch.tensor([[17]])
    times = []
    with torch.inference_mode():
        for step in range(warmup + steps):
            started = time.perf_counter()
            model(token, past_key_values=cache, logits_to_keep=1)
            if step >= warmup:
                times.append(time.perf_counter() - started)
    return times


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as folder:
        model32, model16 = build_model(Path(folder), args)
    config = model32.config
    longest = max(args.contexts)
    print(f"prefill of {longest} tokens ...", flush=True)
    prompt = torch.randint(0, config.vocab_size, (1, longest), generator=torch.Generator().manual_seed(1))
    prefill = make_cache("dynamic", config=config)
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, longest, 512):
            model32(prompt[:, start : start + 512], past_key_values=prefill, logits_to_keep=1)
    print(f"  {time.perf_counter() - started:.1f} s", flush=True)
    context_keys = [layer.keys.clone() for layer in prefill.layers]  # (1, H_kv, L, D) per layer
    context_values = [layer.values.clone() for layer in prefill.layers]
    del prefill

    heads, dim, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    rows = []
    for length in args.contexts:
        step_times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        nbytes: dict[str, int] = {}
        for round_index in range(args.rounds + 1):
            order = KINDS[round_index % len(KINDS):] + KINDS[: round_index % len(KINDS)]
            for kind in order:
                model = model16 if kind == "bf16" else model32
                cache = make(kind, model, context_keys, context_values, length)
                nbytes[kind] = cache.nbytes_used
                times = time_steps(model, cache, args.steps, args.warmup)
                if round_index:  # round 0 is an untimed warm-up
                    step_times[kind] += times
            print(f"context {length}: round {round_index}/{args.rounds} done", flush=True)
        for kind in KINDS:
            median = statistics.median(step_times[kind])
            if kind in BITS:
                steady = quantized_kv_cache_bytes(
                    layers, heads, GROUP, dim, bits=BITS[kind], group_size=GROUP, residual_length=0,
                    dtype="float32",
                ) / GROUP
            else:
                steady = kv_cache_bytes(layers, heads, 1, dim, 1, "bfloat16" if kind == "bf16" else "float32")
            rows.append({
                "context": length, "kind": kind, "cache_bytes": nbytes[kind],
                "bytes_per_token": nbytes[kind] / length, "steady_bytes_per_token": steady,
                "decode_ms": 1000 * median, "decode_tokens_per_s": 1 / median,
                "p90_ms": 1000 * statistics.quantiles(step_times[kind], n=10)[-1],
                "steps": len(step_times[kind]),
            })
    return {
        "model": {"hidden_size": 768, "layers": layers, "heads": 12, "kv_heads": heads, "head_dim": dim,
                  "intermediate_size": 2048, "vocab_size": 32000,
                  "parameters": sum(p.numel() for p in model32.parameters())},
        "quantized": {"group_size": GROUP, "residual_length": RESIDUAL, "key_axis": "channel",
                      "value_axis": "token", "scale_dtype": "float32 (the model's)"},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "settings": vars(args),
        "rows": rows,
    }


def markdown(result: dict) -> str:
    model = result["model"]
    lines = [
        f"Random Llama, {model['parameters'] / 1e6:.0f}M parameters ({model['layers']} layers, "
        f"{model['kv_heads']} kv heads × {model['head_dim']}), batch 1, torch "
        f"{result['machine']['torch']}, {result['machine']['threads']} thread(s).",
        f"Quantized: group {GROUP}, residual {RESIDUAL} tokens in full precision, keys per channel, "
        "values per token, fp32 scales.",
        "",
        "| context | cache | bytes/token (held) | bytes/token (packed, steady) | vs fp32 | "
        "decode tokens/s | vs fp32 |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    by = {(row["context"], row["kind"]): row for row in result["rows"]}
    for row in result["rows"]:
        base = by[(row["context"], "fp32")]
        lines.append(
            f"| {row['context']} | {row['kind']} | {row['bytes_per_token']:,.0f} | "
            f"{row['steady_bytes_per_token']:,.0f} | {base['bytes_per_token'] / row['bytes_per_token']:.2f}× "
            f"smaller | {row['decode_tokens_per_s']:.1f} | "
            f"{row['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}× |"
        )
    return "\n".join(lines) + "\n"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=[512, 4096])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=6, help="timed decode steps per kind per round")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine a second thread "
                        "that gets descheduled stalls every parallel op)")
    parser.add_argument("--quick", action="store_true", help="4 layers, contexts 256 and 1024, 1 round")
    parser.add_argument("--out", help="results prefix (default benchmarks/results/quantized)")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.contexts, args.rounds, args.steps = 4, [256, 1024], 1, 4
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    result = run(args)
    prefix = Path(args.out) if args.out else RESULTS / "quantized"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    table = markdown(result)
    prefix.with_suffix(".md").write_text(table, encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
