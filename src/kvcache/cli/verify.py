"""`kvcache verify`: whether a model's greedy tokens depend on how its prompt was run, on the
user's own model. Random prompts run on the engine cold (the whole prompt in one step), then in
chunks of 1, 16 and 64 tokens, found in the prefix cache (the same prompt a second time), and
beside 7 other prompts in one batch; every stream is compared token by token with the cold one.
Exit status 1 when a stream differs (what differs is printed), 0 when none does."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from kvcache.cli._args import activations_of, add_activations, positive_int

#: the ways a prompt is run, beside the cold one
ROADS = ("chunks of 1", "chunks of 16", "chunks of 64", "prefix cache hit", "batch of 8")
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
    """Where one road's stream first parts from the cold one's."""

    road: str
    prompt: int
    token: int


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
    cold = streams(model, prompts, args.new_tokens, "cold")
    differences = []
    for road in ROADS:
        differences += compared(road, cold, streams(model, prompts, args.new_tokens, road))
    report(args, len(prompts), differences)
    return 1 if differences else 0


def _load(args: argparse.Namespace):
    from kvcache.defaults import resolve_model_dir
    from kvcache.model import load_model

    return load_model(resolve_model_dir(args.model), activations=activations_of(args))


def random_prompts(seed: int, count: int, tokens: int, vocab: int) -> list[list[int]]:
    """`count` prompts of `tokens` token ids drawn uniformly below `vocab` (seeded)."""
    import random

    generator = random.Random(seed)
    return [[generator.randrange(vocab) for _ in range(tokens)] for _ in range(count)]


def streams(model, prompts: list[list[int]], new_tokens: int, road: str) -> list[list[int]]:
    """Each prompt's greedy tokens on the engine, the prompt run as `road` says ("cold" or one
    of ROADS)."""
    from kvcache.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    whole = len(prompts[0]) * (NEIGHBOURS + 1)  # (a batch's prompts in one step)
    budget = {"chunks of 1": 1, "chunks of 16": 16, "chunks of 64": 64}.get(road, whole)
    engine = Engine(model, num_blocks=_blocks(prompts, new_tokens), max_running=min(budget, NEIGHBOURS + 1),
                    token_budget=budget, prefix_caching=road == "prefix cache hit")
    try:
        found = []
        for index, prompt in enumerate(prompts):
            if road == "prefix cache hit":
                engine.submit(prompt, params).result()  # (its blocks cached: the next one attaches them)
            if road == "batch of 8":
                others = random_prompts(index + 1, NEIGHBOURS, len(prompt), model.config.vocab_size)
                handles = [engine.submit(p, params) for p in [*others[:3], prompt, *others[3:]]]
                found.append([handle.result() for handle in handles][3].tokens)
            else:
                found.append(engine.submit(prompt, params).result().tokens)
        return found
    finally:
        engine.close()


def _blocks(prompts: list[list[int]], new_tokens: int) -> int:
    """Pool blocks for a batch of NEIGHBOURS + 1 such requests, and a cached copy of one."""
    per = -(-(len(prompts[0]) + new_tokens) // 16) + 1
    return per * (NEIGHBOURS + 3)


def compared(road: str, cold: list[list[int]], found: list[list[int]]) -> list[Difference]:
    """Where each of a road's streams first differs from the cold one's (none where equal)."""
    differences = []
    for index, (expected, got) in enumerate(zip(cold, found)):
        if expected != got:
            pairs = enumerate(zip(expected, got))
            at = next((i for i, (a, b) in pairs if a != b), min(len(expected), len(got)))
            differences.append(Difference(road, index, at))
    return differences


def report(args: argparse.Namespace, count: int, differences: list[Difference]) -> None:
    """A line a road (streams equal to the cold ones; where the first differing one parts), or JSON."""
    by_road = {road: [d for d in differences if d.road == road] for road in ROADS}
    if args.json:
        roads = {road: {"equal": count - len(found), "differing": [vars(d) for d in found]}
                 for road, found in by_road.items()}
        print(json.dumps({"prompts": count, "prompt_tokens": args.prompt_tokens,
                          "new_tokens": args.new_tokens, "roads": roads}, indent=1))
        return
    for road, found in by_road.items():
        where = "" if not found else f"; first: prompt {found[0].prompt} parts at new token {found[0].token}"
        print(f"{road:>16}: {count - len(found)} of {count} streams equal to the cold run's{where}")
    total = len(differences)
    print(f"{'every stream equal' if not total else f'{total} streams differ'} "
          f"({count} prompts of {args.prompt_tokens} tokens, {args.new_tokens} greedy new tokens each)")
