"""What the docs point at exists: every module docs/engine.md's reading guide names is a file of
the package (the guide drifted once: tokenizers moved to text/ and it still named them bare)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import kvcache

SOURCE = Path(kvcache.__file__).resolve().parent
GUIDE = SOURCE.parents[1] / "docs" / "engine.md"


def guide_modules(text: str) -> list[str]:
    """The `.py` paths the reading guide's section of docs/engine.md names, in order."""
    section = text.split("### Reading guide", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"`([\w/]+\.py)`", section)


def test_every_module_the_reading_guide_names_is_a_file_of_the_package():
    named = guide_modules(GUIDE.read_text(encoding="utf-8"))
    assert len(named) >= 15
    assert [path for path in named if not (SOURCE / path).is_file()] == []


def test_a_bare_or_moved_name_in_the_guide_is_found():
    text = "### Reading guide\n1. `engine/engine.py` (with `tokenizer.py`)\n### Prefix\n`nowhere.py`"
    named = guide_modules(text)
    assert named == ["engine/engine.py", "tokenizer.py"]
    assert [path for path in named if not (SOURCE / path).is_file()] == ["tokenizer.py"]


@pytest.mark.kernels  # (the bundled model's steps run on numba's kernels)
def test_every_module_an_engine_request_crosses_is_named_in_the_guide():
    """A chat request through the engine on the bundled model, traced (the second one: the first
    loads what runs once): every module of the package it runs code in is in the guide."""
    import sys
    import threading

    from kvcache import load_model, load_tokenizer
    from kvcache.engine import Engine

    engine = Engine(load_model(), load_tokenizer())
    chat = [{"role": "user", "content": "Hello there"}]
    crossed: set[str] = set()
    root = str(SOURCE) + "/"

    def note(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(root):
            crossed.add(name[len(root):])

    for traced in (False, True):
        if traced:
            sys.setprofile(note)
            threading.setprofile(note)
        try:
            handle = engine.submit(chat, max_tokens=3)
            while engine.step():
                pass
            handle.result()
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    named = set(guide_modules(GUIDE.read_text(encoding="utf-8")))
    assert crossed and sorted(crossed - named) == []
