"""What structured outputs cost: output tokens/s of `--clients` concurrent requests on one engine,
each running to max_tokens, plain against held to a JSON schema whose output does not complete
within max_tokens (an array of at least 100 digits), alternating rounds in one process (the
order reversed on odd rounds); the CPU seconds of the process's threads per output token of each
run (time.process_time), and the wall time of each run's forwards per step (which a grammar does
not change: their swings are the machine's other load); and the CPU
time (time.thread_time, which other processes' load moves less than wall time) of what a
constrained row adds: its mask computed by llguidance (per row and token) and the sampler's choice
with masks against without. Not a test; results in benchmarks/results/structured_overhead.json
(or --out). The model loads as `kvcache serve -m` loads it (a GGUF's kept blocks with q8 activations).

    .venv/bin/python benchmarks/bench_structured.py [-m NAME_DIR_OR_GGUF] [--clients 16] [--rounds 3]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from bench_common import commit

import kvcache
from kvcache.engine import Engine, SamplingParams, runner
from kvcache.generation.structured import StructuredOutput

RESULTS = Path(__file__).resolve().parent / "results" / "structured_overhead.json"
ENDLESS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 100}


class CpuClock:
    """CPU seconds spent in the runner's mask computation and its choose, and the rows masked."""

    def __init__(self) -> None:
        self.masks = self.choose = 0.0
        self.rows = 0
        allowed, choose = runner._allowed, runner.Runner.choose

        def timed_allowed(states):
            started = time.thread_time()
            result = allowed(states)
            self.masks += time.thread_time() - started
            self.rows += sum(state is not None for state in states)
            return result

        def timed_choose(runner_self, *args):
            started = time.thread_time()
            result = choose(runner_self, *args)
            self.choose += time.thread_time() - started
            return result

        runner._allowed, runner.Runner.choose = timed_allowed, timed_choose

    def take(self) -> tuple[float, float, int]:
        taken = (self.masks, self.choose, self.rows)
        self.masks = self.choose = 0.0
        self.rows = 0
        return taken


class StepClock:
    """Wall seconds of the runner's forwards (Runner.run) and how many ran: a forward's time does
    not depend on a grammar, so its swings are the machine's other load."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        run = runner.Runner.run

        def timed_run(runner_self, work):
            started = time.perf_counter()
            try:
                return run(runner_self, work)
            finally:
                self.seconds += time.perf_counter() - started
                self.steps += 1

        runner.Runner.run = timed_run

    def take(self) -> float:
        """Milliseconds a forward since the last take."""
        taken = 1e3 * self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        return taken


def tokens_per_s(engine: Engine, clients: int, max_tokens: int, structured) -> tuple[float, float]:
    """(output tokens/s, CPU seconds of this process's threads per output token) of `clients`
    requests at once."""
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True,
                             structured=structured) for seed in range(clients)]
    started, cpu = time.perf_counter(), time.process_time()
    handles = [engine.submit(f"Request {seed}: list digits.", p) for seed, p in enumerate(params)]
    made = sum(len(handle.result().tokens) for handle in handles)
    return made / (time.perf_counter() - started), (time.process_time() - cpu) / made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", help="a model name (kvcache pull), checkpoint folder or GGUF "
                        "(default: the bundled tiny model)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS, help="default: results/structured_overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # ("auto": q8 activations for a GGUF's kept blocks, as the commands load it)
    model = kvcache.load_model(args.model, activations="auto")
    tokenizer = kvcache.load_tokenizer(args.model)
    engine = Engine(model, tokenizer, max_running=args.clients, token_budget=max(256, args.clients))
    schema = StructuredOutput("json_schema", json.dumps(ENDLESS))
    tokens_per_s(engine, args.clients, 8, None)  # warm-up: kernels, the token table
    tokens_per_s(engine, args.clients, 8, schema)
    probe = engine.submit("x", SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured=schema))
    assert len(probe.result().tokens) == args.max_tokens, "the schema completed before max_tokens"
    runs: dict = {"plain": [], "held": []}  # (tokens/s, CPU s a token) of each run
    forwards: dict = {"plain": [], "held": []}  # ms a forward, each run
    choose_plain = choose_held = masks = 0.0
    rows = 0
    clock, steps = CpuClock(), StepClock()
    for index in range(args.rounds):  # (held first on odd rounds: a drift of the machine's load is shared)
        for kind in ("plain", "held") if index % 2 == 0 else ("held", "plain"):
            clock.take()
            steps.take()
            structured = schema if kind == "held" else None
            runs[kind].append(tokens_per_s(engine, args.clients, args.max_tokens, structured))
            forwards[kind].append(steps.take())
            mask_s, choose_s, masked = clock.take()
            if structured is None:
                choose_plain += choose_s
            else:
                masks, choose_held, rows = masks + mask_s, choose_held + choose_s, rows + masked
    plain, held = ([speed for speed, _ in runs[kind]] for kind in ("plain", "held"))
    plain_cpu, held_cpu = ([1e3 * cpu for _, cpu in runs[kind]] for kind in ("plain", "held"))
    tokens = args.rounds * args.clients * args.max_tokens
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
        "machine": platform.processor() or platform.machine(), "model": args.model or "bundled tiny model",
        "clients": args.clients, "max_tokens": args.max_tokens, "threads": args.threads, "schema": ENDLESS,
        "plain_tokens_per_s": plain, "schema_tokens_per_s": held,
        "median_overhead": 1 - statistics.median(held) / statistics.median(plain),
        "best_overhead": 1 - max(held) / max(plain),  # (each kind's least disturbed run)
        "plain_forward_ms_per_step": forwards["plain"], "schema_forward_ms_per_step": forwards["held"],
        "plain_cpu_ms_per_token": plain_cpu, "schema_cpu_ms_per_token": held_cpu,
        "median_cpu_overhead": statistics.median(held_cpu) / statistics.median(plain_cpu) - 1,
        "mask_cpu_us_per_row_token": 1e6 * masks / max(rows, 1),
        "choose_cpu_us_per_token_plain": 1e6 * choose_plain / tokens,
        "choose_cpu_us_per_token_schema": 1e6 * choose_held / tokens,
        "command": " ".join(["benchmarks/bench_structured.py", *sys.argv[1:]]),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
