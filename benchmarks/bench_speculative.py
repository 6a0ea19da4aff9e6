"""Speculative decoding (`kvcache generate --speculate ngram`) against plain decoding, and against
llama.cpp's `llama-server --spec-type ngram-simple`, on three sets of chat prompts.

    benchmarks/build_llama_cpp.sh                                   # llama-server, once
    .venv/bin/python benchmarks/bench_speculative.py --llama-server PATH [--gguf qwen2.5-coder-0.5b]

Sets: `code_edit` (rewrite a given function with a small change: the answer repeats the prompt),
`rag_quote` (answer from a given passage, quoting it) and `chat` (open questions: little to draft
from). Every prompt runs greedy through the command a user runs, `kvcache generate -m GGUF --chat
PROMPT --json`, without and with `--speculate ngram` (each a process: its load and warm-up are
outside the figure `decode_tokens_per_s`, which the command reports), and as one request to one
llama-server started with `--spec-type ngram-simple` (its own `timings.predicted_per_second`),
the three in turn, the order reversed on odd rounds. Per prompt and round: speculative over plain
tokens/s (and whether the tokens are identical: they must be), and kvcache's speculative over
llama-server's. Medians per set over prompts and rounds. Writes
benchmarks/results/speculative.json with the command and every run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path
from statistics import median

from bench_common import commit, free_port
from bench_serve_gguf import start, wait_ready

RESULTS = Path(__file__).parent / "results"

_CODE = [
    ("Rename the function moving_average to rolling_mean and change nothing else. Reply with the whole "
     "function in a code block.", '''def moving_average(values, window):
    """Return the moving averages of values over a window of the given size."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''),
    ("Change the default timeout from 30 to 60 seconds and change nothing else. Reply with the whole "
     "function in a code block.", '''def fetch_with_retries(client, url, retries=3, timeout=30):
    """Fetch url with client, retrying failed requests up to `retries` times."""
    last_error = None
    for attempt in range(retries + 1):
        try:
            response = client.get(url, timeout=timeout)
            response.raise_for_status()
            return response.json()
        except (ConnectionError, TimeoutError) as error:
            last_error = error
            wait = min(2 ** attempt, 10)
            time.sleep(wait)
    raise RuntimeError(f"giving up on {url} after {retries} retries") from last_error
'''),
    ("Add a parameter `reverse=False` that sorts in descending order when true, and change nothing "
     "else. Reply with the whole function in a code block.", '''def top_scores(scores, count):
    """The `count` best (name, score) pairs of the dict `scores`, best first."""
    if count < 0:
        raise ValueError("count must not be negative")
    pairs = list(scores.items())
    pairs.sort(key=lambda pair: pair[1])
    pairs.reverse()
    result = []
    for name, score in pairs[:count]:
        result.append((name, score))
    return result
'''),
]
_PASSAGE = (
    "The lighthouse at Port Ellen was built in 1832 by the engineer Robert Stevenson. Its light was first "
    "lit on the night of the first of November, using twelve oil lamps with silvered reflectors. In 1895 "
    "the oil lamps were replaced by a single paraffin burner with a rotating lens, which could be seen "
    "nineteen miles out at sea. The keepers lived in two cottages at the foot of the tower and rowed to "
    "the village for supplies once a week. During the storm of 1911 the tower lost its lantern glass, and "
    "the light was shown from a lamp on the gallery for three months. The light was automated in 1967, "
    "and the last keeper, Angus MacLean, retired that year after thirty-one years of service."
)
_RAG = [
    f"Passage: {_PASSAGE}\n\nQuestion: When was the lighthouse built and when was it automated? Answer "
    "by quoting the two sentences of the passage that say so, word for word.",
    f"Passage: {_PASSAGE}\n\nQuestion: What happened during the storm of 1911, and who was the last "
    "keeper? Quote the sentences of the passage that say so, word for word.",
]
_CHAT = [
    "Write a short poem about the first cold morning of autumn.",
    "Explain to a beginner what a hash table is and why lookups are fast.",
    "Give three practical tips for someone learning to cook at home.",
]
SETS = {
    "code_edit": [f"{task}\n\n```python\n{code}```" for task, code in _CODE],
    "rag_quote": _RAG,
    "chat": _CHAT,
}


def kvcache_run(gguf: str, prompt: str, new_tokens: int, threads: int, speculate: bool) -> dict:
    """One `kvcache generate --json` of the chat prompt: its report (decode_tokens_per_s, tokens…)."""
    command = [sys.executable, "-m", "kvcache", "generate", "-m", gguf, "--chat", prompt, "--max-tokens",
               str(new_tokens), "--threads", str(threads), "--json"]
    if speculate:
        command += ["--speculate", "ngram"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench_speculative: {' '.join(command[:6])} … failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout)


def llama_run(url: str, prompt: str, new_tokens: int) -> dict:
    """One greedy chat request to llama-server: its timings (predicted_per_second, draft counts)."""
    import httpx

    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": new_tokens, "temperature": 0}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600).json()
    timings = reply.get("timings", {})
    return {"decode_tokens_per_s": timings.get("predicted_per_second"),
            "tokens": timings.get("predicted_n"), "draft_n": timings.get("draft_n"),
            "draft_n_accepted": timings.get("draft_n_accepted")}


def one_round(args, gguf: str, url: str, index: int) -> list[dict]:
    """Every prompt of every set once each way, the three in turn (reversed on odd rounds)."""
    runs = []
    for name, prompts in SETS.items():
        for number, prompt in enumerate(prompts):
            ways = ["plain", "speculative", "llama-server"]
            if index % 2:
                ways.reverse()
            row = {}
            for way in ways:
                if way == "llama-server":
                    row[way] = llama_run(url, prompt, args.new_tokens)
                else:
                    row[way] = kvcache_run(gguf, prompt, args.new_tokens, args.threads, way == "speculative")
            plain, fast, theirs = row["plain"], row["speculative"], row["llama-server"]
            run = {"round": index, "set": name, "prompt": number,
                   "plain_tokens_per_s": plain["decode_tokens_per_s"],
                   "speculative_tokens_per_s": fast["decode_tokens_per_s"],
                   "llama_server_spec_tokens_per_s": theirs["decode_tokens_per_s"],
                   "tokens": len(fast["tokens"]), "identical": plain["tokens"] == fast["tokens"],
                   "drafted_tokens": fast["drafted_tokens"], "accepted_tokens": fast["accepted_tokens"],
                   "llama_server": theirs}
            run["speedup"] = run["speculative_tokens_per_s"] / run["plain_tokens_per_s"]
            run["ratio_vs_llama_server_spec"] = (run["speculative_tokens_per_s"]
                                                 / theirs["decode_tokens_per_s"])
            print(f"round {index} {name}[{number}]: plain {run['plain_tokens_per_s']:.1f}, speculative "
                  f"{run['speculative_tokens_per_s']:.1f} tok/s ({run['speedup']:.2f}x, "
                  f"{fast['accepted_tokens']}/{fast['drafted_tokens']} drafted taken, identical "
                  f"{run['identical']}), llama-server ngram {theirs['decode_tokens_per_s']:.1f}",
                  file=sys.stderr, flush=True)
            runs.append(run)
    return runs


def run(args, gguf: str) -> dict:
    """llama-server up with its n-gram speculation, warmed; the rounds; the results' dict."""
    port = free_port()
    command = [args.llama_server, "-m", gguf, "-t", str(args.threads), "-tb", str(args.threads), "-np", "1",
               "-c", "4096", "--port", str(port), "--spec-type", "ngram-simple"]
    url = f"http://127.0.0.1:{port}"
    server = start(command)
    try:
        print(f"waiting for llama-server to load {Path(gguf).name}…", file=sys.stderr, flush=True)
        wait_ready(url, server)
        llama_run(url, "warm up", 8)
        runs = [run for index in range(args.rounds) for run in one_round(args, gguf, url, index)]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    summary = {}
    for name in SETS:
        mine = [run for run in runs if run["set"] == name]
        summary[f"speedup_{name}"] = median(run["speedup"] for run in mine)
        summary[f"ratio_vs_llama_server_spec_{name}"] = median(
            run["ratio_vs_llama_server_spec"] for run in mine)
    return {"commit": commit(), "machine": platform.processor() or platform.machine(),
            "gguf": Path(gguf).name,
            "threads": args.threads, "new_tokens": args.new_tokens, "command": " ".join(sys.argv),
            "llama_server_command": " ".join(command[1:]), "all_identical": all(r["identical"] for r in runs),
            **summary, "ratio_vs_llama_server_spec": summary["ratio_vs_llama_server_spec_code_edit"],
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", required=True, help="llama-server binary (build_llama_cpp.sh)")
    parser.add_argument("--gguf", default="qwen2.5-coder-0.5b",
                        help="a GGUF file or a `kvcache models` name (default qwen2.5-coder-0.5b)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    parser.add_argument("--new-tokens", type=int, default=256, help="new tokens at most (default 256)")
    parser.add_argument("--threads", type=int, default=2, help="threads of each side (default 2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "speculative.json")
    args = parser.parse_args()
    if args.rounds < 1 or args.new_tokens < 2:
        parser.error(f"--rounds must be ≥ 1 and --new-tokens ≥ 2, got {args.rounds} and {args.new_tokens}")
    from kvcache.defaults import resolve_model_dir

    gguf = str(resolve_model_dir(args.gguf))
    results = run(args, gguf)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    for name in SETS:
        print(f"{name}: speculative / plain {results[f'speedup_{name}']:.2f}x, / llama-server ngram "
              f"{results[f'ratio_vs_llama_server_spec_{name}']:.2f}x")
    print(f"tokens identical in every run: {results['all_identical']}")


if __name__ == "__main__":
    main()
