"""Prefix-aware routing against round-robin, at the server: `kvcache serve --replicas 2` on a local
Ray cluster, multi-turn conversations through the OpenAI API, and what the later turns see.

    .venv/bin/python benchmarks/bench_replicas.py                  # SmolLM2-135M, 2 replicas

For each routing (`--routing prefix`, `--routing round-robin`), in an order that rotates every
round: a server is started (one thread per replica), `--conversations` conversations each run
`--turns` turns (a shared system prompt, then a question per turn; greedy, `--new` tokens), the
conversations of a turn sent together on as many connections. Per later turn: the prefix hit
rate (cached prompt tokens over prompt tokens, from `usage`) and the time to first token (from
the client's streamed request to its first content event). Then the routing overhead: the
latency of a one-token request whose prompt the replica holds, on `--replicas 2` against a
single-process `kvcache serve` of the same settings, both up at once and asked in turn (the median
of the paired differences is what the Ray path adds),
and the router's own decision (block hashes of the prompt and the ranking) timed in process. The
same conversations on that single process give the ceiling: one engine holds every conversation,
so its hit rate is the most any routing can reach on this workload (the rest is each turn's new
question, and answers whose tokens the chat template's rendering does not reproduce).

On one 2-core machine more replicas cannot raise throughput: both replicas share the cores, so
the figures here are hit rates and latencies, not throughput. Results:
benchmarks/results/replicas.json (replicas_system_xN.json with --system-repeat N, ..._imbalance_M.json with
--routing-imbalance M). Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench_common import commit

RESULTS = Path(__file__).parent / "results"
ROUTINGS = ("prefix", "round-robin")
SYSTEM = ("You are a patient assistant who explains how things work in plain words, with one "
          "example each time, and who keeps every answer short. ") * 4


class Server:
    """`kvcache serve` started and stopped (SIGTERM)."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags

    def __enter__(self) -> Server:
        command = [sys.executable, "-m", "kvcache", "serve", "--port", "0", "-m", ARGS.model,
                   "--threads", "1", "--log-level", "warning", "--no-access-log", *self.flags]
        print(f"starting: {' '.join(command[2:])}", file=sys.stderr, flush=True)
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                        env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        found: list[str] = []
        reader = threading.Thread(target=lambda: found.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(600)
        match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", found[0] if found else "")
        if match is None:
            self.process.kill()
            raise RuntimeError(f"the server did not start: {found!r}")
        self.url = match.group(1)
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()


def streamed(client, url: str, messages: list[dict], max_tokens: int) -> tuple[str, float, dict]:
    """(reply text, seconds to the first content event, usage) of one streamed chat request."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    started, first, text, usage = time.perf_counter(), None, [], {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    first = first or time.perf_counter() - started
                    text.append(piece)
    return "".join(text), first or time.perf_counter() - started, usage


def conversations_run(url: str) -> list[dict]:
    """Every later turn's {turn, prompt_tokens, cached_tokens, ttft_s}."""
    import httpx

    system = SYSTEM * ARGS.system_repeat
    histories = [[{"role": "system", "content": system}] for _ in range(ARGS.conversations)]
    rows: list[dict] = []
    with httpx.Client() as client, ThreadPoolExecutor(ARGS.conversations) as pool:
        for turn in range(ARGS.turns):
            for index, history in enumerate(histories):
                history.append({"role": "user", "content": f"Conversation {index}, question {turn}: how "
                                f"does a {['lock', 'pump', 'bell', 'kite'][(index + turn) % 4]} work?"})
            replies = list(pool.map(lambda h: streamed(client, url, h, ARGS.new), histories))
            for history, (text, ttft, usage) in zip(histories, replies):
                history.append({"role": "assistant", "content": text})
                if turn:
                    rows.append({"turn": turn, "prompt_tokens": usage["prompt_tokens"],
                                 "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "ttft_s": ttft})
    return rows


def one_token_latency(urls: tuple[str, str], count: int = 40) -> tuple[list[float], list[float]]:
    """Seconds of `count` one-token requests on a prompt each server holds (after one to warm
    it), the two servers side by side: request i goes to both, in an order that alternates."""
    import httpx

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say yes."}]
    times: tuple[list[float], list[float]] = ([], [])
    with httpx.Client() as client:
        for index in range(count + 1):
            for which in ((0, 1) if index % 2 else (1, 0)):
                started = time.perf_counter()
                client.post(f"{urls[which]}/v1/chat/completions", timeout=120,
                            json={"messages": messages, "max_tokens": 1, "temperature": 0})
                if index:
                    times[which].append(time.perf_counter() - started)
    return times


def router_decision_s(count: int = 2000) -> list[float]:
    """Seconds per decision of the router's own work (the prompt's block hashes, the ranking of
    two replicas whose index holds 20,000 blocks each), for a 1,000-token prompt."""
    from kvcache.blocks import prefix_digests
    from kvcache.replicas.prefix_index import PrefixIndex

    index = PrefixIndex()
    for replica in ("a", "b"):
        for start in range(0, 20_000 * 16, 16 * 500):
            index.record(replica, prefix_digests(list(range(start, start + 16 * 500)), 16))
    prompt = list(range(1000))
    index.record("a", prefix_digests(prompt, 16))
    times = []
    for _ in range(count):
        started = time.perf_counter()
        index.rank(["a", "b"], prefix_digests(prompt, 16), {"a": 1, "b": 0}, 8)
        times.append(time.perf_counter() - started)
    return times


def summary(rows: list[dict]) -> dict:
    prompt = sum(row["prompt_tokens"] for row in rows)
    return {"later_turns": len(rows), "prefix_hit_rate": sum(row["cached_tokens"] for row in rows) / prompt,
            "ttft_ms_median": 1000 * statistics.median(row["ttft_s"] for row in rows)}


def main() -> None:
    by_routing: dict[str, list[dict]] = {routing: [] for routing in ROUTINGS}
    for round_ in range(ARGS.rounds):
        order = ROUTINGS if round_ % 2 == 0 else ROUTINGS[::-1]
        for routing in order:
            with Server("--replicas", "2", "--routing", routing, *IMBALANCE_FLAGS) as server:
                by_routing[routing].append(summary(conversations_run(server.url)))
            print(f"round {round_ + 1} {routing}: {by_routing[routing][-1]}", file=sys.stderr, flush=True)
    with Server() as server:  # one engine holds every conversation: the most any routing can find
        ceiling = summary(conversations_run(server.url))
    # (both up: side by side)
    with Server("--replicas", "2", *IMBALANCE_FLAGS) as replicas, Server() as server:
        replicated, single = one_token_latency((replicas.url, server.url))
    decisions = router_decision_s()
    results = {
        "what": "kvcache serve --replicas 2: prefix-aware routing against round-robin (later turns of "
                "multi-turn chats), and the latency the Ray path adds",
        "command": "python benchmarks/bench_replicas.py " + " ".join(sys.argv[1:]),
        "commit": commit(), "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
        "settings": vars(ARGS),
        "by_routing": {routing: {
            "rounds": rows,
            "prefix_hit_rate_median": statistics.median(r["prefix_hit_rate"] for r in rows),
            "ttft_ms_median": statistics.median(r["ttft_ms_median"] for r in rows)} for routing, rows in
            by_routing.items()},
        "single_engine_ceiling": ceiling,
        "ttft_prefix_over_round_robin": statistics.median(
            p["ttft_ms_median"] / r["ttft_ms_median"]
            for p, r in zip(by_routing["prefix"], by_routing["round-robin"])),
        "one_token_request_ms_p50": {"replicas_2": 1000 * statistics.median(replicated),
                                     "single_process": 1000 * statistics.median(single)},
        "added_latency_ms_p50": 1000 * statistics.median(r - s for r, s in zip(replicated, single)),
        "router_decision_ms_p50": 1000 * statistics.median(decisions),
        "note": "one 2-core machine: both replicas share the cores, so more replicas cannot raise "
                "throughput here; hit rates and latencies are what this measures",
    }
    RESULTS.mkdir(exist_ok=True)
    name = "replicas" + (f"_system_x{ARGS.system_repeat}" if ARGS.system_repeat != 1 else "") + (
        f"_imbalance_{ARGS.routing_imbalance}" if ARGS.routing_imbalance is not None else "") + ".json"
    (RESULTS / name).write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k not in ("by_routing", "settings")}, indent=2))
    for routing, data in results["by_routing"].items():
        print(routing, round(data["prefix_hit_rate_median"], 3), round(data["ttft_ms_median"], 1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model path or name (default smollm2)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new", type=int, default=24, help="new tokens per answer")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--system-repeat", type=int, default=1,
                        help="the shared system prompt this many times over (default 1: ~140 tokens)")
    parser.add_argument("--routing-imbalance", type=int,
                        help="the servers' --routing-imbalance (default: theirs)")
    ARGS = parser.parse_args()
    IMBALANCE_FLAGS = () if ARGS.routing_imbalance is None else (
        "--routing-imbalance", str(ARGS.routing_imbalance))
    main()
