"""Time to first token of a long prompt from each tier of prefix blocks: computed (cold), from the
pool (warm in memory), from the disk folder after a restart, and from Redis on a second replica.

    .venv/bin/python benchmarks/bench_kv_tiers.py                  # SmolLM2-135M, 2,048 tokens

Each round: a writer (an Engine on disk + Redis as one TieredStore) answers system prompt +
question 1, its blocks written, and is closed. Then, in an order that rotates every round: a
cold engine (no store), a "restarted" engine (a new DiskBlockStore on the writer's folder: indexed
from file names, as a new process would), and a second replica on Redis alone each answer system
prompt + question 2; the restarted engine then answers question 3 from its own pool (memory).
Greedy, 16 new tokens, 2 threads, float32. Then the same for the same weights with every layer
on a sliding window (`--sliding-window`, default 1024). The files are in the OS page cache (just written), as
after a quick restart; after a reboot the disk's read speed adds to the restart figure.
Results: benchmarks/results/kv_tiers.json and kv_tiers.md, with `restart_ttft_over_cold` (the
median of the per-round ratios). Not a test.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

from bench_common import commit
from bench_kv_store import start_redis

RESULTS = Path(__file__).parent / "results"
ROADS = ("cold", "restart", "redis")


def _round(model, url: str, system: list[int], questions: list[list[int]], order: list[str]) -> dict:
    """One round's TTFTs (s) by road, and the restarted engine's from its own pool."""
    from kvcache.engine import Engine
    from kvcache.tiers.disk_store import DiskBlockStore
    from kvcache.tiers.redis_store import RedisBlockStore
    from kvcache.tiers.tiered_store import TieredStore

    def replica(store=None) -> Engine:
        return Engine(model, kv_store=store, kv_budget="512MiB", block_size=16, max_running=4,
                      token_budget=512)

    def ask(engine: Engine, prompt: list[int]):
        return engine.generate([prompt], max_tokens=16, temperature=0.0, ignore_eos=True)[0]

    with tempfile.TemporaryDirectory() as folder:
        redis = RedisBlockStore(url, ttl_s=600, timeout_s=2.0, max_pending=4096)
        redis._client.flushdb()
        writer = replica(TieredStore([DiskBlockStore(folder, max_pending=4096), redis]))
        ask(writer, system + questions[0])
        assert writer.store_tier.store.flush(120), "the writes did not finish"
        writer.close()
        engines = {"cold": replica(), "restart": replica(DiskBlockStore(folder, timeout_s=5.0)),
                   "redis": replica(RedisBlockStore(url, ttl_s=600, timeout_s=2.0))}
        answers = {road: ask(engines[road], system + questions[1]) for road in order}
        tokens = {tuple(answer.tokens) for answer in answers.values()}
        assert len(tokens) == 1, "a tier answered differently"
        memory = ask(engines["restart"], system + questions[2])
        result = {f"ttft_{road}_s": answers[road].time_to_first_token_s for road in ROADS}
        result["ttft_memory_s"] = memory.time_to_first_token_s
        result["cached_tokens"] = {road: answers[road].usage.cached_tokens for road in ROADS}
        for engine in engines.values():
            engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (its GGUF), default or a path")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sliding-window", type=int, default=1024,
                        help="also the same weights with every layer on a window of this many tokens "
                        "(0: not)")
    args = parser.parse_args()

    import torch

    import kvcache

    torch.set_num_threads(2)
    model = kvcache.load_model(None if args.model == "default" else args.model)
    variants = {"full attention": model}
    if args.sliding_window:
        variants[f"sliding window {args.sliding_window}"] = _windowed(model, args.sliding_window)
    process, url = start_redis()
    results = {}
    try:
        for name, variant in variants.items():
            print(f"{name}:", flush=True)
            results[name] = _rounds(variant, url, args)
    finally:
        process.terminate()
    _write(args, results)


def _windowed(model, window: int):
    """The same weights with every layer attending to a window of `window` tokens (a
    mistral-shaped model, for the tiers' sliding-window path)."""
    import dataclasses

    from kvcache.model.llama import LlamaForCausalLM

    config = dataclasses.replace(model.config, model_type="mistral", sliding_window=window,
                                 layer_types=("sliding_attention",) * model.config.num_hidden_layers)
    windowed = LlamaForCausalLM(config)
    windowed.load_state_dict(model.state_dict())
    return windowed.eval()


def _rounds(model, url: str, args) -> list[dict]:
    generator = random.Random(0)
    vocab = model.config.vocab_size
    system = [generator.randrange(vocab) for _ in range(args.system_tokens)]
    rounds = []
    for index in range(args.rounds):
        questions = [[generator.randrange(vocab) for _ in range(24)] for _ in range(3)]
        order = list(ROADS[index % 3 :] + ROADS[: index % 3])
        result = _round(model, url, system, questions, order)
        for road in ("restart", "redis", "memory"):
            result[f"{road}_over_cold"] = result[f"ttft_{road}_s"] / result["ttft_cold_s"]
        rounds.append(result)
        print(f"  round {index + 1} ({', '.join(order)}): " + ", ".join(
            f"{road} {result[f'ttft_{road}_s']:.3f} s" for road in (*ROADS, "memory")), flush=True)
    return rounds


def _summary(rounds: list[dict]) -> dict:
    return {
        "rounds": rounds,
        **{f"ttft_{road}_s_median": statistics.median(r[f"ttft_{road}_s"] for r in rounds)
           for road in (*ROADS, "memory")},
        **{f"{road}_ttft_over_cold": statistics.median(r[f"{road}_over_cold"] for r in rounds)
           for road in ("restart", "redis", "memory")},
    }


def _write(args, results: dict[str, list[dict]]) -> None:
    import torch

    variants = {name: _summary(rounds) for name, rounds in results.items()}
    summary = {
        "model": args.model, "system_tokens": args.system_tokens,
        "restart_ttft_over_cold": variants["full attention"]["restart_ttft_over_cold"],
        "variants": variants,
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}, 2 threads",
        "commit": commit(), "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_tiers.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# KV tiers: time to first token by where the prefix came from ({summary['date']}, "
        f"commit {summary['commit']})", "",
        f"`.venv/bin/python benchmarks/bench_kv_tiers.py` — {args.model}, a {args.system_tokens}-token "
        f"system prompt + 24-token question, greedy, 16 new tokens; {summary['machine']}; Redis on "
        f"loopback; disk files in the page cache. {args.rounds} rounds a model, the order rotating.", "",
    ]
    for name, variant in variants.items():
        lines += [
            f"## {name}", "",
            "| round | cold (s) | restart, from disk (s) | from Redis (s) | memory (s) | restart / cold |",
            "|---:|---:|---:|---:|---:|---:|",
            *(f"| {i + 1} | {r['ttft_cold_s']:.3f} | {r['ttft_restart_s']:.3f} | {r['ttft_redis_s']:.3f} | "
              f"{r['ttft_memory_s']:.3f} | {r['restart_over_cold']:.3f} |"
              for i, r in enumerate(variant["rounds"])), "",
            f"Medians of the per-round ratios over cold: restart from disk "
            f"{variant['restart_ttft_over_cold']:.3f} (target ≤ 0.15), "
            f"Redis {variant['redis_ttft_over_cold']:.3f}, "
            f"memory {variant['memory_ttft_over_cold']:.3f}.", "",
        ]
    (RESULTS / "kv_tiers.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
