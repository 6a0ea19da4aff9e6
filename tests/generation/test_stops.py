"""Stop strings: one string is one stop string, an empty one is refused, and a stop string fires
however many tokens spell it (byte-level tokens of multi-byte characters included)."""

from __future__ import annotations

import pytest

from kvcache.generation.stops import StopRule


class ByteTokenizer:
    """Token id b is the byte b (what a byte-level BPE falls back to)."""

    @staticmethod
    def encode(text: str) -> list[int]:
        return list(text.encode("utf-8"))

    @staticmethod
    def decode(ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def fires_at(rule: StopRule, ids: list[int]) -> int | None:
    """The index of the token on which `rule` stops, feeding ids one at a time."""
    for end in range(1, len(ids) + 1):
        if rule.reason(ids[:end]) is not None:
            return end - 1
    return None


@pytest.mark.parametrize("stop", ["é" * 20, "日本語の文字列", "😀😀😀😀😀😀", "a" * 40])
def test_a_stop_string_fires_however_many_tokens_spell_it(stop):
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("some text before " + stop + " and after")
    rule = StopRule([], [stop], tokenizer)
    assert fires_at(rule, ids) == len(tokenizer.encode("some text before " + stop)) - 1


def test_a_single_string_is_one_stop_string_not_its_characters():
    tokenizer = ByteTokenizer()
    rule = StopRule([], "END", tokenizer)
    assert rule.stop_strings == ["END"]
    text = "Every Norse Deity ... END"  # E, N, D each appear before the end: characters would fire early
    assert fires_at(rule, tokenizer.encode(text)) == len(text) - 1


@pytest.mark.parametrize("bad", ["", [""], ["ok", ""], [3]])
def test_an_empty_or_non_string_stop_is_refused(bad):
    with pytest.raises(ValueError, match="non-empty str"):
        StopRule([], bad, ByteTokenizer())
