"""What the docs point at exists: every module docs/engine.md's reading guide names is a file of
the package (the guide drifted once: tokenizers moved to text/ and it still named them bare)."""

from __future__ import annotations

import re
from pathlib import Path

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
