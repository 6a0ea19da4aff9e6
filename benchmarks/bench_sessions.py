"""Agent sessions replayed on the engine: several sessions' turns interleaved (each turn: the
history so far, a tool result, a short greedy reply), so each session pauses while the others run
and the pool, holding a fraction of all histories, evicts what a paused session needs. Per
setting, the share of the resumed turns' histories (the previous prompt and reply) served from
caches (`usage.cached_tokens`: attached from the pool or loaded from a tier, at most the history;
a tier holds whole blocks only, so a history's last partial block is recomputed), and whether
every reply equals a cold run's (prefix caching off) token for token. Each engine warms up first
(`Engine.warm_up`). No times: this counts reuse, not speed.

Settings: `lru` (the pool alone, no hints), `lru_disk` (a disk tier below it, no hints) and
`sessions` (the disk tier, every turn hinted with its session id and demote to disk, the last
turn release: kvcache.engine.sessions).

    .venv/bin/python benchmarks/bench_sessions.py --model qwen2.5-coder-0.5b [--sessions 6 --turns 4
        --pool-blocks 36]

Then the prefix-miss explainer's attribution (`sessions_attribution.py`: agent transcripts with
tool pauses replayed through a server on loopback, one injected perturbation of a known cause a
turn; `attribution_accuracy`, a confusion table, `explainer_cost_over_ttft`). `--attribution-only`
runs that part alone and keeps the file's other keys (each part names its model):

    .venv/bin/python benchmarks/bench_sessions.py --attribution-only --model qwen2.5-coder-0.5b

On the bundled tiny model by default (`--model NAME` for another of `kvcache.load_model`'s;
results/sessions.json holds Qwen2.5-Coder-0.5B's, both parts). Results:
benchmarks/results/sessions.json. Not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

from bench_common import commit
from sessions_attribution import run as run_attribution

import kvcache
from kvcache.engine import Engine
from kvcache.engine.sessions import KVHints
from kvcache.tiers.disk_store import DiskBlockStore

RESULTS = Path(__file__).parent / "results"
BLOCK = 8
REPLY = 8  # tokens a turn's reply
TOOL = 16  # tokens of a tool result a turn adds
FIRST = 48  # tokens of a session's first prompt
SETTINGS = (("lru", False, False), ("lru_disk", True, False), ("sessions", True, True))  # tier, hints


def ids(length: int, seed: int, vocab: int) -> list[int]:
    generator = random.Random(seed)
    return [generator.randrange(3, min(vocab, 1000)) for _ in range(length)]


def replay(engine: Engine, sessions: int, turns: int, vocab: int, hinted: bool) -> dict:
    """Every session's turns, interleaved; the replies and the resumed turns' reuse."""
    histories: dict[int, list[int]] = {s: [] for s in range(sessions)}
    replies, cached, reusable = [], 0, 0
    for turn in range(turns):
        for session in range(sessions):
            added = ids(FIRST if turn == 0 else TOOL, seed=1000 * session + turn, vocab=vocab)
            prompt = histories[session] + added
            hints = None
            if hinted:
                last = turn == turns - 1
                hints = KVHints(f"agent-{session}", release=True) if last else KVHints(
                    f"agent-{session}", demote="disk")
            handle = engine.submit(prompt, max_tokens=REPLY, temperature=0.0, ignore_eos=True, hints=hints)
            while not handle.done:
                engine.step()
            completion = handle.result()
            if turn:
                cached += min(completion.usage.cached_tokens, len(histories[session]))
                reusable += len(histories[session])
            replies.append(completion.tokens)
            histories[session] = prompt + completion.tokens
    return {"replies": replies, "resume_hit_rate": round(cached / reusable, 4) if reusable else None,
            "resumed_history_tokens": reusable, "served_from_caches": cached}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a name kvcache.load_model takes (default: bundled)")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--pool-blocks", type=int, default=36)
    parser.add_argument("--attribution-only", action="store_true",
                        help="run only the explainer's attribution replay; keep the file's other keys")
    parser.add_argument("--why-sessions", type=int, default=4, help="attribution replay: agent sessions")
    parser.add_argument("--why-turns", type=int, default=4, help="attribution replay: turns a session")
    parser.add_argument("--why-max-tokens", type=int, default=16, help="attribution replay: tokens a reply")
    parser.add_argument("--why-pool-blocks", type=int, default=256,
                        help="attribution replay: the server's KV pool, in blocks of 16 tokens (filler "
                             "prompts of 1.25 times it evict it)")
    parser.add_argument("--out", type=Path, default=RESULTS / "sessions.json")
    return parser.parse_args()


def resume(model, args: argparse.Namespace) -> dict:
    """The resume hit rates of the three settings and whether their replies equal a cold run's."""
    vocab = model.config.vocab_size
    options = dict(num_blocks=args.pool_blocks, block_size=BLOCK, max_running=1, token_budget=256)
    final = FIRST + args.turns * (REPLY + TOOL) - TOOL
    cold_engine = Engine(model, prefix_caching=False, **options)
    cold_engine.warm_up()
    cold = replay(cold_engine, args.sessions, args.turns, vocab, False)
    runs = {}
    with tempfile.TemporaryDirectory() as folder:
        for name, tier, hinted in SETTINGS:
            store = DiskBlockStore(Path(folder) / name) if tier else None
            engine = Engine(model, kv_store=store, **options)
            engine.warm_up()
            runs[name] = replay(engine, args.sessions, args.turns, vocab, hinted)
            engine.close()
            print(name, runs[name]["resume_hit_rate"], file=sys.stderr)
    return {
        "model": args.model or "bundled default",
        "sessions": args.sessions, "turns": args.turns, "pool_blocks": args.pool_blocks, "block_size": BLOCK,
        "oversubscription": round(args.sessions * final / (args.pool_blocks * BLOCK), 2),
        "resume_hit_rate_sessions": runs["sessions"]["resume_hit_rate"],
        "resume_hit_rate_lru": runs["lru"]["resume_hit_rate"],
        "resume_hit_rate_lru_disk": runs["lru_disk"]["resume_hit_rate"],
        "tokens_identical_to_cold": {name: run["replies"] == cold["replies"] for name, run in runs.items()},
        "runs": {name: {k: v for k, v in run.items() if k != "replies"} for name, run in runs.items()},
        "note": "lru_disk and sessions differ by little: kvcache writes every whole block below the pool "
                "as it is made, so the disk tier alone brings a paused session's history back; the hints "
                "(demote to disk) only choose which unused blocks go first. The tier's writes are "
                "asynchronous, so a run's rates move by a block or two.",
    }


def attribution(model, tokenizer, args: argparse.Namespace, command: str) -> dict:
    """The explainer's attribution replay on a server over a fresh engine (no lower tier)."""
    engine = Engine(model, tokenizer, num_blocks=args.why_pool_blocks, block_size=16)
    engine.warm_up()
    found = run_attribution(engine, tokenizer, args.why_sessions, args.why_turns, args.why_max_tokens)
    print("attribution", found["attribution_accuracy"], found["attribution_confusion"], file=sys.stderr)
    return {"attribution_model": args.model or "bundled default", "attribution_command": command,
            "attribution_commit": commit(), "attribution_pool_blocks": args.why_pool_blocks, **found}


def main() -> None:
    args = arguments()
    model = kvcache.load_model(args.model, activations="auto") if args.model else kvcache.load_model()
    tokenizer = kvcache.load_tokenizer(args.model) if args.model else kvcache.load_tokenizer()
    command = " ".join([".venv/bin/python", "benchmarks/bench_sessions.py", *sys.argv[1:]])
    kept = args.attribution_only and args.out.exists()
    result = json.loads(args.out.read_text(encoding="utf-8")) if kept else {}
    if not args.attribution_only:
        result = {"commit": commit(), "command": command, **resume(model, args)}
    result.update(attribution(model, tokenizer, args, command))
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "attribution_rows")}, indent=2))


if __name__ == "__main__":
    main()
