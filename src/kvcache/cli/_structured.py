"""The structured-output flags of `kvcache generate`: --json-schema FILE (a JSON schema) and
--grammar FILE (a Lark grammar, llguidance's dialect), read into the StructuredOutput the reply
must match."""

from __future__ import annotations

import argparse
import json

from kvcache.files import read_text

MAX_GRAMMAR_BYTES = 1 << 20


def add_structured_flags(parser: argparse.ArgumentParser) -> None:
    """--json-schema and --grammar (one of them at most)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", metavar="FILE",
                       help="hold the reply to this JSON schema (llguidance; compact JSON); it ends once "
                            "the JSON is complete")
    group.add_argument("--grammar", metavar="FILE",
                       help="hold the reply to this Lark grammar (llguidance's dialect)")


def structured_of(args: argparse.Namespace):
    """The StructuredOutput the flags ask for, or None; ValueError naming the flag and the file."""
    from kvcache.generation.params import RequestError
    from kvcache.generation.structured import StructuredOutput

    path, flag = (args.json_schema, "--json-schema") if args.json_schema else (args.grammar, "--grammar")
    if path is None:
        return None
    text = read_text(path, f"{flag} file", MAX_GRAMMAR_BYTES)
    if flag == "--json-schema":
        try:
            json.loads(text)
        except ValueError as error:
            raise ValueError(f"{flag} {path} is not JSON: {error}") from None
    try:
        return StructuredOutput("json_schema" if flag == "--json-schema" else "grammar", text,
                                field=f"{flag} {path}")
    except RequestError as error:
        raise ValueError(str(error)) from None
