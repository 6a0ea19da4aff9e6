"""`kvcache serve`'s opt-in repairs of prefix-cache misses (docs/why-miss.md): each flag is off by
default, on when given, and names a server setting that is off by default."""

from __future__ import annotations

import argparse
import dataclasses

from kvcache.cli import serve
from kvcache.server import ServerSettings

REPAIRS = {"--restore-reasoning": "restore_reasoning", "--canonical-history": "canonical_history",
           "--prerender-next-turn": "prerender_next_turn"}


def arguments(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_parser(parser)
    return parser.parse_args(list(argv))


def test_each_repair_is_off_by_default_and_on_with_its_flag():
    plain = arguments()
    assert not any(getattr(plain, field) for field in REPAIRS.values())
    for flag, field in REPAIRS.items():
        given = arguments(flag)
        assert getattr(given, field) and not any(
            getattr(given, other) for other in REPAIRS.values() if other != field)


def test_each_repairs_setting_is_off_by_default():
    defaults = {field.name: field.default for field in dataclasses.fields(ServerSettings)}
    assert all(defaults[field] is False for field in REPAIRS.values())
