"""The `kvcache` command line. This package is the only place that parses arguments or prints.

Each command lives in its own module here with two functions: `add_parser(subparsers)` and
`run(args) -> int` (the exit status). Modules are imported when their command runs, so
`kvcache count` never imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import warnings

from kvcache import __version__

# command name -> (module under kvcache.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "count": ("count", "count multiplications per token with and without a KV cache"),
    "memory": ("memory", "KV-cache memory for a model shape or a config.json, and capacity"),
    "lab": ("lab", "the whole KV-cache lab: equality, counts, rounding, memory"),
    "generate": ("generate", "generate text with a local checkpoint, streamed, with timings"),
    "drift": ("drift", "how far a quantized KV cache moves the output, against tolerance"),
    "report": ("report", "counted and measured figures in one document, with plots"),
    "serve": ("serve", "an OpenAI-compatible HTTP server on the engine (continuous batching)"),
    "chat": ("chat", "an interactive multi-turn chat that keeps the conversation's cache"),
    "models": ("models", "the model names -m takes: each one's size and where it is, or how to pull it"),
    "pull": ("pull", "fetch a named model's GGUF file (checked by its SHA-256) into your cache folder"),
    "why": ("why", "why a request to a running serve missed the prefix cache, and where"),
    "verify": ("verify", "whether greedy tokens depend on how a prompt was run: chunked, cached, batched"),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per command (`.commands`: name -> sub-parser)."""
    parser = argparse.ArgumentParser(
        prog="kvcache",
        description="Key-value caching for transformer inference.",
    )
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        module = _command_module(module_name)
        if module is None:
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_parser(sub)
    parser.commands = subparsers.choices  # command name -> its parser
    return parser


def _command_module(module_name: str):
    try:
        return importlib.import_module(f"kvcache.cli.{module_name}")
    except ModuleNotFoundError as error:
        if error.name == f"kvcache.cli.{module_name}":
            return None  # command not built yet
        raise


def main(argv: list[str] | None = None) -> int:
    """Run the `kvcache` command with `argv` (default: sys.argv[1:]); returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if unknown:  # the command's own usage and error (exit status 2), not the top level's
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    module = _command_module(COMMANDS[args.command][0])
    try:
        with warnings.catch_warnings():  # a warning is one line naming the command, no source line
            warnings.showwarning = _warning_line(args.command)
            return int(module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: one line, the shell's code for SIGINT, no traceback
        print(f"\nkvcache {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `| head` closed the pipe: nothing more to write, and no traceback
        # point stdout at /dev/null so the interpreter's final flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a program the pipe killed reports


def console_main() -> None:
    """The `kvcache` command (console script and `python -m kvcache`): `main()`, then the process
    ends at once, its output flushed. The interpreter's own teardown (torch's modules, the compiled
    kernels' thread pools) took about a second after a command was done, after serve's "stopped";
    every file a command writes is closed before it returns, and the KV store's writer is a daemon
    thread whose queued blocks are dropped at exit either way."""
    import logging

    try:
        code = main()
    except SystemExit as leaving:  # argparse's usage errors and --help
        code = leaving.code if isinstance(leaving.code, int) else 0 if leaving.code is None else 1
        if isinstance(leaving.code, str):
            print(leaving.code, file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: nothing to keep
            stream.flush()
    logging.shutdown()
    os._exit(code)


def _warning_line(command: str):
    """A `warnings.showwarning` that prints `kvcache COMMAND: warning: MESSAGE` to stderr."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        print(f"kvcache {command}: warning: {message}", file=sys.stderr)

    return show
