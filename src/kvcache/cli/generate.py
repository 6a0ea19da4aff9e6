"""`kvcache generate`: stream text from a local checkpoint folder and print the timings.

    kvcache generate --model DIR --chat "Hello, what's your name?" --max-new-tokens 32
    kvcache generate --model DIR --prompt "Once upon a time" --cache static --compare-nocache

torch is imported inside `run`, so building the command-line parser stays torch-free.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from pathlib import Path

from kvcache.cli._args import (
    WEIGHTS_HELD_TWICE,
    activations_of,
    add_activations,
    add_kv_cache_dtype,
    add_speculate,
    folder_argument,
    kv_dtype_of,
    kv_window_of,
    positive_int,
    size_argument,
)
from kvcache.cli._status import BAR_AFTER_S, choose_threads, compiling_said, say_weights
from kvcache.cli._structured import add_structured_flags, structured_of
from kvcache.defaults import BACKEND_NAMES, CACHE_KINDS, resolve_model_dir
from kvcache.memory import parse_size

LOADING = "kvcache generate: loading the model"
WARMING = "kvcache generate: warming up (untimed)"
NO_CACHE = "kvcache generate: no cache"


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = WEIGHTS_HELD_TWICE
    parser.add_argument(
        "-m",
        "--model",
        help="local checkpoint folder (config.json, safetensors) or GGUF file; default: the bundled "
        "default model",
    )
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--prompt", help="plain text to continue ('-' reads it from standard input)")
    text.add_argument("--chat", help="a user message, wrapped in the checkpoint's chat template")
    parser.add_argument("--max-tokens", "--max-new-tokens", dest="max_new_tokens", type=positive_int,
                        default=64, help="new tokens at most (default 64; --max-new-tokens is the same)")
    parser.add_argument("-c", "--ctx-size", type=positive_int,
                        help="tokens of context, prompt and new ones (default: the model's); "
                             "--max-tokens is lowered to fit it, said on stderr")
    parser.add_argument("--cache", choices=CACHE_KINDS,
                        help="default paged: each forward a one-request paged step on the backend, as the "
                        "server runs them; the other kinds run on the model's own torch forward (the "
                        "reference road)")
    parser.add_argument(
        "--kv-disk", metavar="DIR", type=folder_argument,
        help="read the prompt's KV blocks that files under DIR hold instead of computing them, and "
        "write its blocks there for later runs (a paged cache; the read is inside the time to first "
        "token)",
    )
    parser.add_argument("--kv-disk-size", type=size_argument, default=parse_size("8GiB"),
                        help="the most --kv-disk's blocks take (default 8GiB)")
    add_kv_cache_dtype(parser)
    parser.add_argument(
        "--compare-nocache",
        action="store_true",
        help="also generate without a cache; report whether the tokens are identical and the speed ratio",
    )
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: as stored")
    add_activations(parser)
    parser.add_argument("--prefill-chunk", type=positive_int, help="prefill this many tokens at a time")
    add_speculate(parser, "the prompt and output")
    parser.add_argument("--draft-tokens", type=positive_int,
                        help="the most tokens a --speculate draft holds (default 15: a verify step of 16 "
                        "tokens, which runs on the layer kernels)")
    parser.add_argument("--sample", action="store_true",
                        help="sample instead of greedy decoding (default: the checkpoint's "
                             "generation_config.json, else greedy)")
    parser.add_argument("--temperature", type=float,
                        help="sample at this temperature (implies --sample; 0 means greedy)")
    parser.add_argument("--top-k", type=positive_int, help="sample from the k likeliest (implies --sample)")
    parser.add_argument("--top-p", type=float, help="nucleus sampling (implies --sample)")
    parser.add_argument("--min-p", type=float,
                        help="drop tokens less likely than this times the likeliest (implies --sample)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the positive logits (multiply the negative) of tokens in the prompt "
                             "or the reply by this, greedy too (> 0; default 1: off)")
    parser.add_argument("--seed", type=int,
                        help="seed of the sampling generator (default: a new one each run, printed)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (text, tokens, timings) instead of streaming the text")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    add_structured_flags(parser)
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads (default: torch's, one per core, less the cores other processes "
                        "of normal priority kept busy while the model loaded: the kernels' threads wait "
                        "for each other at every layer: one sharing a core with other work slows them all)")
    parser.add_argument(
        "--backend",
        choices=BACKEND_NAMES,
        default="auto",
        help="what runs a paged cache's steps: blocks (a GGUF's kept blocks), float32 (float32 models on "
        "CPU), half (bfloat16/float16 on CPU), the model's torch forward, or auto: the first that applies "
        "(default); the other cache kinds run on the torch forward",
    )


class _TextStream:
    """Prints the text of new tokens as they come (`ReplyText`: no broken characters)."""

    def __init__(self, tokenizer, out) -> None:
        from kvcache.generation.text import ReplyText

        self.text = ReplyText(tokenizer)
        self.out = out
        self.written = False  # whether a line of text is open on `out`

    def __call__(self, step_tokens) -> None:
        piece = self.text.add(int(step_tokens[0]))
        self.written = self.written or bool(piece)
        self.out.write(piece)
        self.out.flush()

    def finish(self) -> None:
        self.out.write(self.text.finish())
        self.out.flush()


def _sampling(args: argparse.Namespace, folder: Path) -> dict:
    """do_sample, temperature, top_k, top_p, min_p: as given; a sampling flag alone implies
    sampling (as in llama.cpp and mlx-lm; --temperature 0 is greedy); what the command line leaves
    out comes from the checkpoint's generation_config.json, as transformers reads it.
    repetition_penalty: the flag's only (a file's would change greedy answers unasked)."""
    from kvcache.files import read_json_object

    defaults = {}
    settings_file = folder / "generation_config.json" if folder.is_dir() else None
    if settings_file is not None and settings_file.is_file():
        defaults = read_json_object(settings_file, "generation_config.json")
    given = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p}
    chosen = {name: value if value is not None else defaults.get(name) for name, value in given.items()}
    sample = args.sample or any(value is not None for value in given.values())
    if not sample and args.temperature is None:
        sample = bool(defaults.get("do_sample", False))
    if chosen["temperature"] is not None and chosen["temperature"] == 0:  # llama.cpp's greedy
        sample, chosen["temperature"] = False, None
    return {"do_sample": sample, "temperature": chosen["temperature"] or 1.0,
            "top_k": chosen["top_k"], "top_p": chosen["top_p"], "min_p": chosen["min_p"],
            "repetition_penalty": args.repetition_penalty}


def run(args: argparse.Namespace) -> int:

    from kvcache.backends.cpu.threads import CoreWatch

    watch = CoreWatch()
    try:
        model, tokenizer, input_ids, sampling = _load(args)
    except (ValueError, OSError) as error:
        print(f"kvcache generate: error: {error}", file=sys.stderr)
        return 2
    choose_threads("generate", args.threads, watch)
    # an unseeded sampled run differs every time; the seed is printed so it can be repeated
    seed = args.seed if args.seed is not None else (secrets.randbits(31) if sampling["do_sample"] else 0)
    stream = None if args.json else _TextStream(tokenizer, sys.stdout)
    runs = _Runs(model, tokenizer, input_ids, sampling, seed, args)
    try:
        with compiling_said("generate"):
            runs.warm_up()
        result = runs.timed(stream)
    except (ValueError, OSError) as error:  # BackendError, CacheError; a --kv-disk folder refused
        if stream is not None and stream.written:
            print(flush=True)  # end the text printed so far
        print(f"kvcache generate: error: {error}", file=sys.stderr)
        return 2
    report = runs.report(result)
    if stream is not None:
        stream.finish()
        print(flush=True)
        print(runs.summary(result), file=sys.stderr)
        print(_timing_line(result), file=sys.stderr, flush=True)
    status = 0
    if args.compare_nocache:
        lines = runs.compare_nocache(result, report)
        if stream is not None:
            print("\n".join(lines), file=sys.stderr)
        status = 0 if report["identical_to_nocache"] else 1
    if args.json:
        print(json.dumps(report))
    return status


def _load(args: argparse.Namespace):
    """(model, tokenizer, prompt ids (1, T), sampling options) as the arguments say, loading with
    a progress bar on stderr; ValueError or OSError naming what is wrong."""
    from kvcache.model import load_model
    from kvcache.report.progress import ProgressBar
    from kvcache.text.tokenizer import load_tokenizer

    args.cache = args.cache or "paged"
    if args.kv_disk and args.cache != "paged":
        raise ValueError(f"--kv-disk keeps a paged cache's blocks: give --cache paged (or none), not "
                         f"{args.cache}")
    kv_window_of(args)  # (refused without a kv dtype)
    if kv_dtype_of(args) and args.cache != "paged":
        raise ValueError(f"--kv-cache-dtype {kv_dtype_of(args)} sets a paged cache's blocks' dtype: give "
                         f"--cache paged (or none), not {args.cache}")
    folder = Path(resolve_model_dir(args.model))
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    sampling = _sampling(args, folder)
    args.structured = structured_of(args)
    model = load_model(folder, dtype=args.dtype, progress=ProgressBar(LOADING, after_s=BAR_AFTER_S),
                       activations=activations_of(args))
    say_weights("generate", model)
    tokenizer = load_tokenizer(folder)
    if args.chat is not None:
        messages = [{"role": "user", "content": args.chat}]
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    else:
        input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    args.max_new_tokens = _fitted_max_tokens(args, model.config.max_position_embeddings, input_ids.shape[1])
    return model, tokenizer, input_ids, sampling


def _fitted_max_tokens(args: argparse.Namespace, context: int, prompt_tokens: int) -> int:
    """--max-tokens, lowered (and said on stderr) where the prompt and it pass --ctx-size (default:
    the model's context); ValueError for a context past the model's or a prompt that fills it."""
    ctx = args.ctx_size or context
    if ctx > context:
        raise ValueError(f"--ctx-size {ctx} is past the model's context of {context} tokens "
                         "(max_position_embeddings)")
    if prompt_tokens >= ctx:
        raise ValueError(f"the prompt has {prompt_tokens} tokens, which leaves no room for a new one "
                         f"in a context of {ctx} (--ctx-size)")
    if prompt_tokens + args.max_new_tokens <= ctx:
        return args.max_new_tokens
    room = ctx - prompt_tokens
    print(f"kvcache generate: at most {room} new tokens fit a context of {ctx} (--ctx-size) after the "
          f"{prompt_tokens}-token prompt, not --max-tokens {args.max_new_tokens}", file=sys.stderr)
    return room


class _Runs:
    """The generations one command makes from one loaded model: warm-up, the timed run, and the
    no-cache run it is compared with, on the same options."""

    def __init__(self, model, tokenizer, input_ids, sampling: dict, seed: int, args) -> None:
        from kvcache.text.eos import default_eos

        self.model, self.tokenizer, self.input_ids = model, tokenizer, input_ids
        self.sampling, self.seed, self.args = sampling, seed, args
        self.tokens_from_disk = 0
        self.options = dict(
            max_new_tokens=args.max_new_tokens,
            **sampling,
            eos_token_id=default_eos(model.config.eos_token_id, tokenizer),
            stop_strings=args.stop or None,
            tokenizer=tokenizer,
            prefill_chunk_size=args.prefill_chunk,
            structured=args.structured,
            speculate=args.speculate,
            draft_tokens=args.draft_tokens,
        )

    def generate(self, cache: str, streamer=None, input_ids=None, **changes):
        """One generation with `cache` (the timed one when no changes), seeded."""
        import torch

        from kvcache.generation import generate

        backend = self.args.backend
        input_ids = self.input_ids if input_ids is None else input_ids
        if cache == "paged" and kv_dtype_of(self.args):  # (quantized: made here, sized as generate would)
            from kvcache.cache import make_cache

            length = input_ids.shape[1] + changes.get("max_new_tokens", self.options["max_new_tokens"])
            cache = make_cache("paged", config=self.model.config, dtype=self.model.dtype, max_batch_size=1,
                               max_cache_len=length, kv_dtype=kv_dtype_of(self.args),
                               kv_window=kv_window_of(self.args))
        return generate(
            self.model, input_ids, cache=cache, backend=backend,
            streamer=streamer, generator=torch.Generator().manual_seed(self.seed),
            **{**self.options, **changes},
        )

    def timed(self, streamer):
        """The timed generation: with `--cache`, or with --kv-disk in a paged row that first reads
        the prompt's blocks the folder holds (that read inside the time to first token, and the
        tokens read in the report as `tokens_from_disk`)."""
        if not self.args.kv_disk:
            return self.generate(self.args.cache, streamer=streamer)
        import dataclasses
        import time

        import torch

        from kvcache.reuse.prefix import ChatSession
        from kvcache.tiers.disk_store import DiskBlockStore

        store = DiskBlockStore(self.args.kv_disk, max_bytes=self.args.kv_disk_size)
        total = self.input_ids.shape[1] + self.args.max_new_tokens
        options = {name: value for name, value in self.options.items() if name != "tokenizer"}
        session = ChatSession(self.model, self.tokenizer, kv_store=store, num_blocks=-(-total // 16) + 1,
                              kv_dtype=kv_dtype_of(self.args), kv_window=kv_window_of(self.args), **options)
        started = time.perf_counter()
        try:
            session.send_ids(self.input_ids[0].tolist(), streamer=streamer, backend=self.args.backend,
                             tokenizer=self.tokenizer, generator=torch.Generator().manual_seed(self.seed))
            elapsed = time.perf_counter() - started  # (the blocks' writing, after, is not the answer's)
        finally:
            session.close()
            store.close()
        result = session.last_result
        outside = elapsed - result.time_to_first_token_s - result.decode_time_s
        self.tokens_from_disk = session.last_turn[0]
        return dataclasses.replace(result, time_to_first_token_s=result.time_to_first_token_s + outside)

    def warm_up(self) -> None:
        """Two greedy tokens on each road the timed runs take, untimed, said on stderr: on the
        first run of an install the kernels are compiled here (seconds), not inside the figures.
        Up to 32 prompt tokens: past a backend's `kernel_rows` (16 at most) a step runs its
        products outside the layer calls, which the timed prompt then finds compiled. The
        options are checked first: a bad one is the command's one error line."""
        from kvcache.generation.settings import GenerationSettings

        GenerationSettings(**{k: v for k, v in self.options.items() if k != "tokenizer"})
        print(f"{WARMING}…", file=sys.stderr, flush=True)
        short = dict(input_ids=self.input_ids[:, :32], max_new_tokens=2, do_sample=False, stop_strings=None)
        self.generate(self.args.cache, **short)
        if self.args.compare_nocache:
            self.generate("none", **short, **_PLAIN)

    def summary(self, result) -> str:
        """The bracketed line after the text: what ran."""
        how = f"sampled, seed {self.seed}" if self.sampling["do_sample"] else "greedy"
        return (
            f"[{len(result.new_tokens[0])} new tokens after a {self.input_ids.shape[1]}-token prompt; "
            f"stopped by {result.stop_reasons[0]}; cache {self.args.cache}"
            f"{'' if kv_dtype_of(self.args) is None else ' ' + kv_dtype_of(self.args)}"
            f"{f' (last {self.args.kv_window} tokens exact)' if self.args.kv_window else ''}; "
            f"{self.model.dtype}; "
            f"decode step {result.backend}; {how}"
            + (f"; speculate {self.args.speculate}: {result.accepted_tokens} of {result.drafted_tokens} "
               "drafted tokens taken" if self.args.speculate else "")
            + (f"; {self.tokens_from_disk} prompt tokens read from --kv-disk]" if self.args.kv_disk else "]")
        )

    def report(self, result) -> dict:
        """The --json object of the timed run."""
        new = result.new_tokens[0]
        return {"text": self.tokenizer.decode(new, skip_special_tokens=True), "tokens": new,
                "prompt_tokens": int(self.input_ids.shape[1]), "stop_reason": result.stop_reasons[0],
                "cache": self.args.cache, "kv_cache_dtype": kv_dtype_of(self.args) or "auto",
                "kv_window": self.args.kv_window,
                "dtype": str(self.model.dtype).removeprefix("torch."),
                "decode_step": result.backend, "seed": self.seed, **self.sampling,
                "time_to_first_token_s": result.time_to_first_token_s,
                "decode_tokens_per_s": result.decode_tokens_per_s,
                **({"speculate": self.args.speculate, "drafted_tokens": result.drafted_tokens,
                    "accepted_tokens": result.accepted_tokens} if self.args.speculate else {}),
                **({"tokens_from_disk": self.tokens_from_disk} if self.args.kv_disk else {})}

    def compare_nocache(self, result, report: dict) -> list[str]:
        """Generate again without a cache, said on stderr first (every step recomputes the whole
        sequence: many times slower) with a bar while it runs long; record in `report` whether
        the tokens are the same and the speed ratio, and return the lines that say so."""
        from kvcache.report.progress import ProgressBar

        count = len(result.new_tokens[0])
        print(f"kvcache generate: generating the {count} tokens again without a cache to compare (every "
              "step recomputes the whole sequence)…", file=sys.stderr, flush=True)
        bar, made = ProgressBar(NO_CACHE, after_s=BAR_AFTER_S), []

        def counted(step_tokens) -> None:
            made.append(step_tokens)
            bar(len(made) / max(count, 1), "tokens made again")

        plain = self.generate("none", streamer=counted, **_PLAIN)
        if bar.last_label is not None:
            bar(1.0, "tokens made again")  # (a bar on a terminal ends its line)
        same = plain.new_tokens[0] == result.new_tokens[0]
        report["identical_to_nocache"] = same
        lines = [f"no cache: {_timing_line(plain)}",
                 f"tokens identical to the no-cache run: {'yes' if same else 'NO'}"]
        if plain.decode_tokens_per_s > 0 and result.decode_tokens_per_s > 0:
            ratio = result.decode_tokens_per_s / plain.decode_tokens_per_s
            lines.append(f"decode speed, cache {self.args.cache} / no cache: {ratio:.2f}x")
            report["decode_speedup_vs_nocache"] = ratio
        return lines


#: the no-cache run speculates not (it keeps no cache to verify drafts in)
_PLAIN = {"speculate": None, "draft_tokens": None}


def _timing_line(result) -> str:
    return (
        f"time to first token {result.time_to_first_token_s * 1000:.1f} ms, "
        f"decode {result.decode_tokens_per_s:.1f} tokens/s over {result.decode_steps} steps"
    )
