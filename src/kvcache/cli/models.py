"""`kvcache models`: the model names -m takes, each with its size and where it is (an installed
package's file or one `kvcache pull` fetched), or how to fetch it."""

from __future__ import annotations

import argparse
import sys

from kvcache.defaults import KNOWN_MODELS, KnownModel, model_cache_dir, model_location


def add_parser(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("A name goes wherever -m takes a model: kvcache generate -m NAME, chat, serve, "
                     "report, memory. kvcache pull NAME fetches one that is not here.")


def where(model: KnownModel) -> str:
    """Where `model` is, or what to run to have it."""
    try:
        found = model_location(model)
    except ValueError as error:
        return f"damaged: {error}"
    if found is None:
        return f"not installed: run kvcache pull {model.name}"
    kind, path = found
    package = f" (package {model.parts[0].package})" if kind == "installed" else ""
    return f"{kind}{package}: {path}"


def run(args: argparse.Namespace) -> int:
    rows = [("name", "size", "model", "where")]
    rows += [(model.name, f"{model.size / 1e6:.1f} MB", model.title, where(model))
             for model in KNOWN_MODELS.values()]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    print(f"kvcache models: pulled models are kept in {model_cache_dir()}", file=sys.stderr)
    return 0
