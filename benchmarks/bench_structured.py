"""What structured outputs cost: output tokens/s of `--clients` concurrent requests on one engine,
each running to max_tokens, plain against held to a JSON schema whose output does not complete
within max_tokens (an array of at least 100 digits), alternating rounds in one process; and the CPU
time (time.thread_time, which other processes' load moves less than wall time) of what a
constrained row adds: its mask computed by llguidance (per row and token) and the sampler's choice
with masks against without. Not a test; results in benchmarks/results/structured_overhead.json.

    .venv/bin/python benchmarks/bench_structured.py [--model DIR_OR_GGUF] [--clients 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

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


def tokens_per_s(engine: Engine, clients: int, max_tokens: int, structured) -> float:
    params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True,
                             structured=structured) for seed in range(clients)]
    started = time.perf_counter()
    handles = [engine.submit(f"Request {seed}: list digits.", p) for seed, p in enumerate(params)]
    made = sum(len(handle.result().tokens) for handle in handles)
    return made / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or GGUF (default: the bundled tiny model)")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcache.load_model(args.model), kvcache.load_tokenizer(args.model)
    engine = Engine(model, tokenizer, max_running=args.clients, token_budget=max(256, args.clients))
    schema = StructuredOutput("json_schema", json.dumps(ENDLESS))
    tokens_per_s(engine, args.clients, 8, None)  # warm-up: kernels, the token table
    tokens_per_s(engine, args.clients, 8, schema)
    probe = engine.submit("x", SamplingParams(max_tokens=args.max_tokens, temperature=1.0, structured=schema))
    assert len(probe.result().tokens) == args.max_tokens, "the schema completed before max_tokens"
    plain, held, choose_plain, choose_held, masks, rows = [], [], 0.0, 0.0, 0.0, 0
    clock = CpuClock()
    for _ in range(args.rounds):
        clock.take()
        plain.append(tokens_per_s(engine, args.clients, args.max_tokens, None))
        choose_plain += clock.take()[1]
        held.append(tokens_per_s(engine, args.clients, args.max_tokens, schema))
        mask_s, choose_s, masked = clock.take()
        masks, choose_held, rows = masks + mask_s, choose_held + choose_s, rows + masked
    tokens = args.rounds * args.clients * args.max_tokens
    result = {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": platform.processor() or
        platform.machine(), "model": args.model or "bundled tiny model", "clients": args.clients,
        "max_tokens": args.max_tokens, "threads": args.threads, "schema": ENDLESS,
        "plain_tokens_per_s": plain, "schema_tokens_per_s": held,
        "median_overhead": 1 - statistics.median(held) / statistics.median(plain),
        "mask_cpu_us_per_row_token": 1e6 * masks / max(rows, 1),
        "choose_cpu_us_per_token_plain": 1e6 * choose_plain / tokens,
        "choose_cpu_us_per_token_schema": 1e6 * choose_held / tokens,
        "command": f"benchmarks/bench_structured.py --clients {args.clients} --rounds {args.rounds}"
                   + (f" --model {args.model}" if args.model else ""),
    }
    print(json.dumps(result, indent=1))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
