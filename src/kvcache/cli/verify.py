"""`kvcache verify`: whether a model's greedy tokens depend on how its prompt was run, on the
user's own model. Random prompts run on the engine cold (the whole prompt in one step), then in
chunks of 1, 16 and 64 tokens, found in the prefix cache (the same prompt a second time), read
back from the disk tier by an engine started after the one that wrote it, and beside 7 other
prompts in one batch; every stream is compared with the cold one token by token, each token's
log-probability to the bit too (a logit that moved in its last bits shows there, before it
turns a near tie into another token). Exit status 1 when a stream differs (what differs is
printed), 0 when none does."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import dataclass

from kvcache.cli._args import activations_of, add_activations, positive_int

#: the ways a prompt is run, beside the cold one
ROADS = ("chunks of 1", "chunks of 16", "chunks of 64", "prefix cache hit", "disk restore", "batch of 8")
#: the roads whose prompts are found in a cache: the prompt tokens found are counted and said
HITS = ("prefix cache hit", "disk restore")
NEIGHBOURS = 7


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-m", "--model", help="local checkpoint folder or GGUF file, or a name `kvcache "
                        "models` lists; default: the bundled default model")
    add_activations(parser)
    parser.add_argument("--prompts", type=positive_int, default=8, help="random prompts (default 8)")
    parser.add_argument("--prompt-tokens", type=positive_int, default=80,
                        help="tokens a prompt (default 80)")
    parser.add_argument("--new-tokens", type=positive_int, default=16,
                        help="greedy new tokens a stream (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="the prompts' random seed (default 0)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


@dataclass
class Difference:
    """Where one road's stream first parts from the cold one's: another token, or the same token
    with another log-probability (`logprob_only`)."""

    road: str
    prompt: int
    token: int
    logprob_only: bool = False


def run(args: argparse.Namespace) -> int:
    try:
        model = _load(args)
        if args.prompt_tokens + args.new_tokens > model.config.max_position_embeddings:
            raise ValueError(f"--prompt-tokens {args.prompt_tokens} + --new-tokens {args.new_tokens} exceed "
                             f"the model's context of {model.config.max_position_embeddings} tokens")
    except (OSError, ValueError) as error:
        print(f"kvcache verify: error: {error}", file=sys.stderr)
        return 1
    prompts = random_prompts(args.seed, args.prompts, args.prompt_tokens, model.config.vocab_size)
    print(f"kvcache verify: {len(prompts)} prompts × {1 + len(ROADS)} roads (compiling kernels on a first "
          "run)…", file=sys.stderr, flush=True)
    cold, _ = streams(model, prompts, args.new_tokens, "cold")
    differences, found = [], {}
    for road in ROADS:
        got, found[road] = streams(model, prompts, args.new_tokens, road)
        differences += compared(road, cold, got)
    report(args, len(prompts), differences, {road: found[road] for road in HITS})
    missed = [road for road in HITS if not found[road]]
    if missed:
        print(f"kvcache verify: error: no prompt token was found in the cache on {', '.join(missed)} "
              f"(prompts shorter than a block, {BLOCK} tokens?): those roads were not tried", file=sys.stderr)
    return 1 if differences or missed else 0


def _load(args: argparse.Namespace):
    from kvcache.defaults import resolve_model_dir
    from kvcache.model import load_model

    return load_model(resolve_model_dir(args.model), activations=activations_of(args))


def random_prompts(seed: int, count: int, tokens: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `tokens` token ids drawn uniformly below `vocab` (seeded)."""
    import random

    generator = random.Random(seed)
    return [[generator.randrange(vocab) for _ in range(tokens)] for _ in range(count)]


#: the engine's block size here (a prompt is found in a cache a whole block at a time)
BLOCK = 16


def streams(model, prompts: list[list[int]], new_tokens: int, road: str) -> tuple[list[list], int]:
    """(each prompt's greedy stream on the engine, (token, its log-probability) a new token, the
    prompt run as `road` says ("cold" or one of ROADS); the prompt tokens found in a cache, in
    all)."""
    from kvcache.engine import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    if road == "disk restore":  # one engine writes the blocks, one started after it reads them
        with tempfile.TemporaryDirectory(prefix="kvcache-verify-") as folder:  # (private: 0700)
            each_prompt(_engine(model, prompts, new_tokens, road, folder), prompts, params, flush=True)
            return each_prompt(_engine(model, prompts, new_tokens, road, folder), prompts, params)
    engine = _engine(model, prompts, new_tokens, road)
    if road != "batch of 8":
        return each_prompt(engine, prompts, params, again=road == "prefix cache hit")
    try:
        found = []
        for index, prompt in enumerate(prompts):
            others = random_prompts(index + 1, NEIGHBOURS, len(prompt), model.config.vocab_size)
            handles = [engine.submit(p, params) for p in [*others[:3], prompt, *others[3:]]]
            found.append(_stream([handle.result() for handle in handles][3]))
        return found, 0
    finally:
        engine.close()


def each_prompt(engine, prompts, params, again: bool = False, flush: bool = False):
    """(each prompt's tokens on `engine`, run one after another (each twice with `again`: the
    second finds the first's blocks); the prompt tokens found in a cache), the engine closed
    after (its disk tier's writes finished first with `flush`)."""
    try:
        found, cached = [], 0
        for prompt in prompts:
            if again:
                engine.submit(prompt, params).result()
            done = engine.submit(prompt, params).result()
            found.append(_stream(done))
            cached += done.usage.cached_tokens
        if flush and not engine.store_tier.store.flush():
            raise OSError("the disk tier did not finish writing the prompts' blocks")
        return found, cached
    finally:
        engine.close()


def _stream(done) -> list[tuple[int, float]]:
    """A finished request's (token, log-probability) pairs."""
    return [(token, chosen.logprob) for token, chosen in zip(done.tokens, done.logprobs)]


def _engine(model, prompts: list[list[int]], new_tokens: int, road: str, folder: str | None = None):
    """The engine of `road`: its steps' token budget, prefix caching, its disk tier in `folder`;
    blocks for a batch of NEIGHBOURS + 1 requests and a cached copy of one."""
    from kvcache.engine import Engine

    whole = len(prompts[0]) * (NEIGHBOURS + 1)  # (a batch's prompts in one step)
    budget = {"chunks of 1": 1, "chunks of 16": 16, "chunks of 64": 64}.get(road, whole)
    blocks = (-(-(len(prompts[0]) + new_tokens) // BLOCK) + 1) * (NEIGHBOURS + 3)
    store = None
    if folder is not None:
        from kvcache.tiers.disk_store import DiskBlockStore

        store = DiskBlockStore(folder)
    return Engine(model, num_blocks=blocks, block_size=BLOCK, max_running=min(budget, NEIGHBOURS + 1),
                  token_budget=budget, prefix_caching=road in HITS, kv_store=store)


def compared(road: str, cold: list[list], found: list[list]) -> list[Difference]:
    """Where each of a road's streams ((token, log-probability) pairs) first differs from the
    cold one's (none where equal)."""
    differences = []
    for index, (expected, got) in enumerate(zip(cold, found)):
        if expected != got:
            pairs = enumerate(zip(expected, got))
            at = next((i for i, (a, b) in pairs if a != b), min(len(expected), len(got)))
            same_token = at < min(len(expected), len(got)) and expected[at][0] == got[at][0]
            differences.append(Difference(road, index, at, same_token))
    return differences


def report(args: argparse.Namespace, count: int, differences: list[Difference],
           cached: dict[str, int]) -> None:
    """A line a road (streams equal to the cold ones; where the first differing one parts; the
    prompt tokens a cache gave), or JSON."""
    by_road = {road: [d for d in differences if d.road == road] for road in ROADS}
    if args.json:
        roads = {road: {"equal": count - len(found), "differing": [vars(d) for d in found],
                        **({"cached_tokens": cached[road]} if road in cached else {})}
                 for road, found in by_road.items()}
        print(json.dumps({"prompts": count, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens, "roads": roads}, indent=1))
        return
    for road, found in by_road.items():
        where = "" if not found else (f"; first: prompt {found[0].prompt} parts at new token {found[0].token}"
                                      f"{' (its log-probability only)' if found[0].logprob_only else ''}")
        hits = f" ({cached[road]} prompt tokens from the cache)" if road in cached else ""
        print(f"{road:>16}: {count - len(found)} of {count} streams equal to the cold run's{hits}{where}")
    total = len(differences)
    print(f"{'every stream equal' if not total else f'{total} streams differ'} "
          f"({count} prompts of {args.prompt_tokens} tokens, {args.new_tokens} greedy new tokens each)")
