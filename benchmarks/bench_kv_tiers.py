"""Time to first token of a long prompt from each tier of prefix blocks: computed (cold), from the
pool (warm in memory), from the disk folder after a restart, and from Redis on a second replica.

    .venv/bin/python benchmarks/bench_kv_tiers.py                  # SmolLM2-135M, 2,048 tokens

Each round: a writer (an Engine on disk + Redis as one TieredStore) answers system prompt +
question 1, its blocks written, and is closed. Then, in an order that rotates every round: a
cold engine (no store), a "restarted" engine (a new DiskBlockStore on the writer's folder: indexed
from file names, as a new process would), and a second replica on Redis alone each answer system
prompt + question 2; the restarted engine then answers question 3 from its own pool (memory).
Greedy, 16 new tokens, 2 threads, float32. The files are in the OS page cache (just written), as
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
    from kvcache.engine.disk_store import DiskBlockStore
    from kvcache.engine.redis_store import RedisBlockStore
    from kvcache.engine.tiered_store import TieredStore

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
    args = parser.parse_args()

    import torch

    import kvcache

    torch.set_num_threads(2)
    model = kvcache.load_model(None if args.model == "default" else args.model)
    generator = random.Random(0)
    vocab = model.config.vocab_size
    system = [generator.randrange(vocab) for _ in range(args.system_tokens)]
    process, url = start_redis()
    rounds = []
    try:
        for index in range(args.rounds):
            questions = [[generator.randrange(vocab) for _ in range(24)] for _ in range(3)]
            order = list(ROADS[index % 3 :] + ROADS[: index % 3])
            result = _round(model, url, system, questions, order)
            for road in ("restart", "redis", "memory"):
                result[f"{road}_over_cold"] = result[f"ttft_{road}_s"] / result["ttft_cold_s"]
            rounds.append(result)
            print(f"round {index + 1} ({', '.join(order)}): " + ", ".join(
                f"{road} {result[f'ttft_{road}_s']:.3f} s" for road in (*ROADS, "memory")), flush=True)
    finally:
        process.terminate()
    _write(args, model, rounds)


def _write(args, model, rounds: list[dict]) -> None:
    import torch

    summary = {
        "model": args.model, "system_tokens": args.system_tokens, "rounds": rounds,
        **{f"ttft_{road}_s_median": statistics.median(r[f"ttft_{road}_s"] for r in rounds)
           for road in (*ROADS, "memory")},
        **{f"{road}_ttft_over_cold": statistics.median(r[f"{road}_over_cold"] for r in rounds)
           for road in ("restart", "redis", "memory")},
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
        f"loopback; disk files in the page cache. {len(rounds)} rounds, the order rotating.", "",
        "| round | cold (s) | restart, from disk (s) | from Redis (s) | memory (s) | restart / cold |",
        "|---:|---:|---:|---:|---:|---:|",
        *(f"| {i + 1} | {r['ttft_cold_s']:.3f} | {r['ttft_restart_s']:.3f} | {r['ttft_redis_s']:.3f} | "
          f"{r['ttft_memory_s']:.3f} | {r['restart_over_cold']:.3f} |" for i, r in enumerate(rounds)), "",
        f"Medians of the per-round ratios over cold: restart from disk "
        f"{summary['restart_ttft_over_cold']:.3f} (target ≤ 0.15), "
        f"Redis {summary['redis_ttft_over_cold']:.3f}, "
        f"memory {summary['memory_ttft_over_cold']:.3f}.", "",
    ]
    (RESULTS / "kv_tiers.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
