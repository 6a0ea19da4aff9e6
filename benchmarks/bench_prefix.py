"""Prefix reuse in a multi-turn conversation, and how many sequences fit in a memory budget.

Part 1, an 8-turn conversation (greedy), three ways side by side, turn by turn in one loop:
  without reuse  every turn re-sends the whole history into a fresh dynamic cache;
  session        `ChatSession` keeps the conversation in a PagedCache row: each turn runs only
                 what the cache does not hold (the new message, plus the previous reply's last
                 token, whose keys were never computed);
  automatic      `PrefixCache` gets the whole history each turn and attaches the cached full
                 blocks of the earlier turns (at most block_size - 1 tokens more than session).
Reported: prompt tokens run through the model and prefill seconds (time to first token) per
way, totals over the turns (the median of --repeats runs), and whether every reply is the same.
With a tokenizer that has a chat template the turns are chat messages rendered by it; with the
random model they are token ids.

Part 2, sequences of --seq-len tokens in --budget (default 1000 tokens, 1 GiB), by allocation:
  paged    a PagedCache whose pool fills the budget, rows reserved until OutOfBlocksError;
  dynamic  DynamicCaches prefilled with the whole sequence, allocated until the budget is full;
           and one sequence decoded token by token (growth ×1.5 overshoots), budget // its bytes;
and what `kvcache memory` predicts for both.

Part 3, the seam's cost per decode step at --seq-len tokens of context: median microseconds of
`begin(1)` + one `update` per layer (no model), paged vs dynamic, taking turns.

    .venv/bin/python benchmarks/bench_prefix.py --json                 # default model if present
    .venv/bin/python benchmarks/bench_prefix.py --model DIR --json
    .venv/bin/python benchmarks/bench_prefix.py --random --json        # random ~3M Llama

Writes benchmarks/results/prefix.json and prefix.md (or --out PREFIX).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from kvcache.cache import DynamicCache, OutOfBlocksError, PagedCache
from kvcache.defaults import default_model_dir
from kvcache.generation import generate
from kvcache.memory import KVShape, max_paged_sequences, max_sequences, paged_block_bytes, parse_size
from kvcache.reuse.prefix import ChatSession, PrefixCache

RESULTS = Path(__file__).parent / "results"
DEFAULT_MODEL = default_model_dir()
USER_MESSAGES = [
    "Hi! Can you tell me what a key-value cache is?",
    "Why do the keys of earlier tokens never change?",
    "How much memory does it take for a long conversation?",
    "What is a block table?",
    "And what happens when two requests share a prompt?",
    "Can the cache be saved to disk?",
    "What is copy on write?",
    "Thanks. Summarise what we said in one sentence.",
]


def random_model(seed: int = 0):
    """A random-weight Llama of the default model's shape (~3M parameters, vocab 512)."""
    from kvcache.model import LlamaForCausalLM, ModelConfig

    config = ModelConfig.from_dict(dict(
        model_type="llama", vocab_size=512, hidden_size=256, intermediate_size=688,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=4096, tie_word_embeddings=True,
    ))
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(0.05 * torch.randn_like(param) + (1.0 if "norm" in name else 0.0))
    return model


def load(args):
    """(model, tokenizer or None, description)."""
    path = args.model or (None if args.random else DEFAULT_MODEL if DEFAULT_MODEL.is_dir() else None)
    if path is None:
        return random_model(), None, "random ~3M Llama (hidden 256, 4 layers, 8 heads, 4 kv heads), fp32"
    from kvcache.model import load_model
    from kvcache.text.tokenizer import load_tokenizer

    model = load_model(path, dtype="float32")
    tokenizer = None
    try:
        tokenizer = load_tokenizer(path)
        if tokenizer.chat_template is None:
            tokenizer = None
    except Exception:  # no tokenizer files: token-id turns
        tokenizer = None
    return model, tokenizer, f"{Path(path).name}, fp32"


def conversation(model, tokenizer, args) -> dict:
    """One run of the three ways, turn by turn; per-turn figures and totals."""
    options = dict(max_new_tokens=args.reply_tokens, eos_token_id=() if tokenizer is None else None)
    # room for the whole conversation twice (the kept row, and the automatic path's blocks)
    blocks = 2 * args.turns * (args.user_tokens + args.reply_tokens + 64) // args.block_size + 16
    session = ChatSession(model, tokenizer, num_blocks=blocks, block_size=args.block_size, **options)
    server = PrefixCache(model, num_blocks=blocks, block_size=args.block_size)
    ids_source = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    history: list[int] = []
    turns = []
    for turn in range(args.turns):
        if tokenizer is None:
            prompt = history + torch.randint(4, vocab, (args.user_tokens,), generator=ids_source).tolist()
        else:
            session.messages.append({"role": "user", "content": USER_MESSAGES[turn % len(USER_MESSAGES)]})
            prompt = list(tokenizer.apply_chat_template(session.messages, add_generation_prompt=True))
        before = session.prefilled_tokens
        started = time.perf_counter()
        reply = session.send_ids(prompt)
        session_total = time.perf_counter() - started
        session_prefill = session.last_result.time_to_first_token_s
        if tokenizer is not None:
            session.messages.append(
                {"role": "assistant", "content": tokenizer.decode(reply, skip_special_tokens=True)}
            )

        started = time.perf_counter()
        plain = generate(model, torch.tensor([prompt]), cache="dynamic", **options)
        plain_total = time.perf_counter() - started

        started = time.perf_counter()
        served = server.generate(prompt, **options)
        automatic_total = time.perf_counter() - started

        turns.append({
            "turn": turn + 1,
            "prompt_tokens": len(prompt),
            "reply_tokens": len(reply),
            "prefill_tokens_without_reuse": len(prompt),
            "prefill_tokens_with_reuse": session.prefilled_tokens - before,
            "prefill_tokens_automatic_reuse": served.prefilled_tokens,
            "seconds_without_reuse": plain.time_to_first_token_s,
            "seconds_with_reuse": session_prefill,
            "seconds_automatic_reuse": served.result.time_to_first_token_s,
            "total_seconds_without_reuse": plain_total,
            "total_seconds_with_reuse": session_total,
            "total_seconds_automatic_reuse": automatic_total,
            "tokens_identical": reply == plain.new_tokens[0] == served.new_tokens,
        })
        history = prompt + reply
    return {"turns": turns}


def memory_fit(model, args) -> dict:
    """Sequences of seq_len tokens in the budget: paged vs dynamic, by allocation, and predicted."""
    config, dtype = model.config, model.dtype
    shape = KVShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    dtype_name = str(dtype).removeprefix("torch.")
    heads, dim, tokens, budget = config.num_key_value_heads, config.head_dim, args.seq_len, args.budget

    num_blocks = budget // paged_block_bytes(shape, args.block_size, dtype_name)
    pool = PagedCache(num_blocks, args.block_size, config=config, dtype=dtype)
    pool_bytes = pool.nbytes
    paged = 0
    while True:
        pool.add_sequence()
        try:
            pool.allocator.reserve([pool.rows[-1]], [tokens])
        except OutOfBlocksError:
            break
        paged += 1
    del pool

    chunk = torch.zeros(1, heads, tokens, dim, dtype=dtype)  # (1, H_kv, T, D)
    caches, used = [], 0
    while True:
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(chunk, chunk, layer)
        if used + cache.nbytes > budget:
            per_prefilled = cache.nbytes
            break
        caches.append(cache)
        used += cache.nbytes
    dynamic_prefilled = len(caches)
    del caches

    grown = DynamicCache(config=config)
    row = torch.zeros(1, heads, 1, dim, dtype=dtype)  # (1, H_kv, 1, D)
    for _ in range(tokens):
        for layer in range(config.num_hidden_layers):
            grown.update(row, row, layer)
    return {
        "budget_bytes": budget,
        "seq_len": tokens,
        "block_size": args.block_size,
        "dtype": dtype_name,
        "paged_pool_bytes": pool_bytes,
        "paged_sequences_allocated": paged,
        "paged_sequences_kvcache_memory": max_paged_sequences(
            shape, budget, tokens, args.block_size, dtype_name),
        "dynamic_prefilled_bytes_per_sequence": per_prefilled,
        "dynamic_prefilled_sequences_allocated": dynamic_prefilled,
        "dynamic_decoded_bytes_per_sequence": grown.nbytes,
        "dynamic_decoded_sequences": budget // grown.nbytes,
        "exact_sequences_kvcache_memory": max_sequences(shape, budget, tokens, dtype_name),
    }


def seam_step(model, args, steps: int = 200) -> dict:
    """Median µs of one decode step through the seam (masks + every layer's update), no model."""
    config, dtype = model.config, model.dtype
    heads, dim, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    blocks = 2 * (-(-(args.seq_len + 2 * steps) // args.block_size))
    caches = {
        "dynamic": DynamicCache(config=config),
        "paged": PagedCache(blocks, args.block_size, config=config, dtype=dtype),
    }
    prompt = torch.randn(1, heads, args.seq_len, dim, dtype=dtype)  # (1, H_kv, T, D)
    row = torch.randn(1, heads, 1, dim, dtype=dtype)  # (1, H_kv, 1, D)
    times: dict[str, list[float]] = {name: [] for name in caches}
    for cache in caches.values():
        for layer in range(layers):
            cache.update(prompt, prompt, layer)
    for _ in range(steps):
        for name, cache in caches.items():
            started = time.perf_counter()
            cache.begin(1)
            for layer in range(layers):
                cache.update(row, row, layer)
            times[name].append(time.perf_counter() - started)
    return {f"seam_step_us_{name}": round(statistics.median(t) * 1e6, 1) for name, t in times.items()}


def summarise(runs: list[dict], args, description: str, memory: dict) -> dict:
    first = runs[0]["turns"]

    def total(key: str) -> float:
        return statistics.median(sum(turn[key] for turn in run["turns"]) for run in runs)

    return {
        "model": description,
        "turns": len(first),
        "block_size": args.block_size,
        "reply_tokens_max": args.reply_tokens,
        "repeats": len(runs),
        "prefill_tokens_with_reuse": sum(t["prefill_tokens_with_reuse"] for t in first),
        "prefill_tokens_automatic_reuse": sum(t["prefill_tokens_automatic_reuse"] for t in first),
        "prefill_tokens_without_reuse": sum(t["prefill_tokens_without_reuse"] for t in first),
        "seconds_with_reuse": round(total("seconds_with_reuse"), 4),
        "seconds_automatic_reuse": round(total("seconds_automatic_reuse"), 4),
        "seconds_without_reuse": round(total("seconds_without_reuse"), 4),
        "total_seconds_with_reuse": round(total("total_seconds_with_reuse"), 4),
        "total_seconds_automatic_reuse": round(total("total_seconds_automatic_reuse"), 4),
        "total_seconds_without_reuse": round(total("total_seconds_without_reuse"), 4),
        "tokens_identical": all(t["tokens_identical"] for run in runs for t in run["turns"]),
        "per_turn": first,
        "memory": memory,
        "machine": f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
    }


def markdown(result: dict) -> str:
    lines = [
        f"Model: {result['model']}; {result['turns']} turns, block size {result['block_size']}, "
        f"median of {result['repeats']} runs.",
        "",
        "| way | prompt tokens run | prefill s | total s |",
        "|---|---|---|---|",
    ]
    for way, key in (("without reuse (re-send history)", "without_reuse"),
                     ("ChatSession (kept row)", "with_reuse"),
                     ("PrefixCache (whole history, cached blocks)", "automatic_reuse")):
        lines.append(f"| {way} | {result['prefill_tokens_' + key]} | {result['seconds_' + key]} | "
                     f"{result['total_seconds_' + key]} |")
    lines += ["", f"Same replies in every turn and way: {result['tokens_identical']}.", ""]
    memory = result["memory"]
    lines += [
        f"Sequences of {memory['seq_len']} tokens in {memory['budget_bytes'] / 2**30:g} GiB "
        f"({memory['dtype']}):",
        "",
        "| cache | allocated | `kvcache memory` |",
        "|---|---|---|",
        f"| paged, blocks of {memory['block_size']} | {memory['paged_sequences_allocated']} | "
        f"{memory['paged_sequences_kvcache_memory']} |",
        f"| dynamic, prefilled whole | {memory['dynamic_prefilled_sequences_allocated']} | "
        f"{memory['exact_sequences_kvcache_memory']} (exact, no rounding) |",
        f"| dynamic, decoded token by token | {memory['dynamic_decoded_sequences']} "
        f"(budget // one sequence's bytes) | |",
        "",
        f"Seam cost of one decode step at {memory['seq_len']} tokens (masks + every layer's "
        f"update, no model): paged {result['seam_step_us_paged']} µs, "
        f"dynamic {result['seam_step_us_dynamic']} µs (median).",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint folder (default: the default model if present)")
    parser.add_argument("--random", action="store_true", help="use a random ~3M Llama")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--user-tokens", type=int, default=48, help="tokens per user turn (random model)")
    parser.add_argument("--reply-tokens", type=int, default=32, help="most tokens per reply")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1000)
    parser.add_argument("--budget", type=parse_size, default=parse_size("1GiB"))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: on a shared 2-core machine two threads "
                             "wait on each other and a tiny model runs ~10× slower)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument("--out", default=str(RESULTS / "prefix"), help="write OUT.json and OUT.md")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    model, tokenizer, description = load(args)
    with torch.inference_mode():
        generate(model, torch.tensor([[5, 6, 7]]), max_new_tokens=4)  # warm-up
        runs = [conversation(model, tokenizer, args) for _ in range(args.repeats)]
        memory = memory_fit(model, args)
        seam = seam_step(model, args)
    result = summarise(runs, args, description, memory)
    result.update(seam, seam_context_tokens=args.seq_len)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result))


if __name__ == "__main__":
    main()
