"""`kvcache chat`: an interactive multi-turn chat in the terminal that keeps the conversation's
KV cache between turns, so each turn prefills only what is new.

    kvcache chat                                   # the bundled model
    kvcache chat --model DIR --system "You are terse." --max-tokens 200
    printf 'Hello\\nWhat is a class?\\n' | kvcache chat   # piped: one turn per line

Each reply streams as it is made; after it, a line on stderr gives the tokens reused from the
cache and prefilled, and the decode speed. Commands: /reset (a new conversation), /system TEXT
(set the system message and reset), /help, /exit (or end of input).
"""

from __future__ import annotations

import argparse
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
from kvcache.defaults import resolve_model_dir
from kvcache.memory import parse_size

DEFAULT_CTX = 8192
BLOCK = 16
HELP = "commands: /reset (new conversation), /system TEXT (set the system message, reset), /help, /exit"


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = WEIGHTS_HELD_TWICE
    parser.add_argument(
        "-m", "--model", help="local checkpoint folder or GGUF file; default: the bundled default model"
    )
    parser.add_argument("--system", help="a system message that opens the conversation")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=256, help="tokens per reply at most (default 256)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (the default) is greedy; else sample"
    )
    parser.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature > 0)")
    parser.add_argument("--min-p", type=float,
                        help="drop tokens less likely than this times the likeliest (with --temperature > 0)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0,
                        help="divide the positive logits (multiply the negative) of tokens in the prompt "
                             "or the reply by this, greedy too (> 0; default 1: off)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling generator")
    parser.add_argument(
        "-c", "--ctx-size", type=positive_int,
        help="tokens the conversation may hold, in KV blocks of 16 (default: the model's context, "
        f"at most {DEFAULT_CTX})",
    )
    parser.add_argument(
        "--kv-disk", metavar="DIR", type=folder_argument,
        help="keep the conversation's KV blocks in files under DIR: a later chat that starts the same "
        "way (a long system message) reads them instead of computing them (default: none)",
    )
    parser.add_argument("--kv-disk-size", type=size_argument, default=parse_size("8GiB"),
                        help="the most --kv-disk's blocks take (default 8GiB)")
    add_kv_cache_dtype(parser)
    add_activations(parser)
    add_speculate(parser, "the turn's prompt and reply")
    parser.add_argument("--threads", type=positive_int,
                        help="CPU threads (default: torch's, one per core, less the cores other processes "
                        "of normal priority kept busy while the model loaded: the kernels' threads wait "
                        "for each other at every layer: one sharing a core with other work slows them all)")


class _Chat:
    """One conversation at a time (a ChatSession), and how a turn is shown."""

    def __init__(self, model, tokenizer, args, out, err) -> None:
        import torch

        from kvcache.generation.settings import GenerationSettings
        from kvcache.text.eos import default_eos

        self.model, self.tokenizer, self.args, self.out, self.err = model, tokenizer, args, out, err
        self.system = args.system
        self.generator = torch.Generator().manual_seed(args.seed)
        self.options = dict(
            max_new_tokens=args.max_tokens,
            eos_token_id=default_eos(model.config.eos_token_id, tokenizer),
            do_sample=args.temperature > 0,
            temperature=args.temperature if args.temperature > 0 else 1.0,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            speculate=args.speculate,
        )
        GenerationSettings(**self.options)  # a bad --min-p or --repetition-penalty: one error line
        self.session = None
        self.store = None
        if args.kv_disk:
            from kvcache.tiers.disk_store import DiskBlockStore

            self.store = DiskBlockStore(args.kv_disk, max_bytes=args.kv_disk_size)
        self.reset()

    def close(self) -> None:
        """End the conversation; blocks queued for --kv-disk are written first."""
        self.session.close()
        if self.store is not None:
            self.store.close()

    def reset(self) -> None:
        from kvcache.reuse.prefix import ChatSession

        if self.session is not None:
            self.session.close()
        self.session = ChatSession(
            self.model, self.tokenizer, num_blocks=-(-self.args.ctx_size // BLOCK), block_size=BLOCK,
            system=self.system, kv_store=self.store, kv_dtype=kv_dtype_of(self.args),
            kv_window=kv_window_of(self.args),
        )

    def warm_up(self) -> None:
        """A two-token turn, untimed and forgotten: an install's first run compiles the kernels
        here, not inside the first reply's tokens/s."""
        self.session.store_tier = None  # (nothing read from --kv-disk, nothing written there)
        self.session.send("Hello", generator=self.generator, **{**self.options, "max_new_tokens": 2})
        self.reset()

    def turn(self, text: str) -> None:
        from kvcache.generation.text import ReplyText

        reply = ReplyText(self.tokenizer)

        def stream(step_tokens) -> None:
            self.out.write(reply.add(int(step_tokens[0])))
            self.out.flush()

        try:
            self.session.send(text, streamer=stream, generator=self.generator, **self.options)
        except KeyboardInterrupt:
            self.out.write("\n")
            self.err.write("[interrupted: the turn is dropped]\n")
            return
        self.out.write(reply.finish() + "\n")
        self.out.flush()
        result = self.session.last_result
        reused, prefilled = self.session.last_turn
        drafts = (f"; {result.accepted_tokens} of {result.drafted_tokens} drafted tokens taken"
                  if self.args.speculate else "")
        self.err.write(
            f"[reused {reused} tokens from the cache, prefilled {prefilled}; {len(result.new_tokens[0])} new "
            f"tokens, {result.decode_tokens_per_s:.0f} tokens/s{drafts}; {self.session.held_tokens} tokens "
            "held]\n"
        )
        self.err.flush()

    def command(self, line: str) -> bool:
        """Run a /command; False for /exit."""
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.reset()
            self.err.write("[a new conversation]\n")
        elif name == "/system":
            self.system = rest.strip() or None
            self.reset()
            self.err.write(f"[system message {'set' if self.system else 'cleared'}; a new conversation]\n")
        elif name == "/help":
            self.err.write(HELP + "\n")
        else:
            self.err.write(f"unknown command {name!r}; {HELP}\n")
        return True


def _context(ctx_size: int | None, model_context: int) -> int:
    """--ctx-size, or the model's context (at most DEFAULT_CTX); ValueError past the model's."""
    if ctx_size is None:
        return min(model_context, DEFAULT_CTX)
    if ctx_size > model_context:
        raise ValueError(f"--ctx-size {ctx_size} is past the model's context of {model_context} tokens "
                         "(max_position_embeddings)")
    return ctx_size


def run(args: argparse.Namespace) -> int:
    from kvcache.backends.cpu.threads import CoreWatch
    from kvcache.model import load_model
    from kvcache.report.progress import ProgressBar
    from kvcache.text.tokenizer import load_tokenizer

    if args.temperature < 0 or (args.top_p is not None and not 0 < args.top_p <= 1):
        print("kvcache chat: error: --temperature must be >= 0 and --top-p in (0, 1]", file=sys.stderr)
        return 2
    watch = CoreWatch()
    try:
        folder = Path(resolve_model_dir(args.model))
        bar = ProgressBar("kvcache chat: loading the model", after_s=BAR_AFTER_S)
        model = load_model(folder, progress=bar, activations=activations_of(args))
        say_weights("chat", model)
        choose_threads("chat", args.threads, watch)
        tokenizer = load_tokenizer(folder)
        args.ctx_size = _context(args.ctx_size, model.config.max_position_embeddings)
        chat = _Chat(model, tokenizer, args, sys.stdout, sys.stderr)
        tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True)
        print("kvcache chat: warming up (untimed)…", file=sys.stderr, flush=True)
        with compiling_said("chat"):
            chat.warm_up()
    except (ValueError, OSError) as error:
        print(f"kvcache chat: error: {error}", file=sys.stderr)
        return 2
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"kvcache chat with {folder.name}; {HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        except KeyboardInterrupt:
            print(file=sys.stderr)
            break
        if not interactive and line == "":
            break  # end of piped input
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            if not chat.command(line):
                break
            continue
        try:
            chat.turn(line)
        except ValueError as error:  # a conversation past the cache or the context, a template refusal
            print(f"kvcache chat: error: {error}", file=sys.stderr)
            if not interactive:
                chat.close()
                return 1
            print("[the turn is dropped; /reset starts a new conversation]", file=sys.stderr)
    chat.close()
    return 0
