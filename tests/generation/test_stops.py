"""Stop strings: one string is one stop string, an empty one is refused, and a stop string fires
however many tokens spell it (byte-level tokens of multi-byte characters included); the rule reads
the text once: what it returns is the reply cut before the stop, and EOS ends it by id."""

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
    for index, token in enumerate(ids):
        rule.take(token)
        if rule.reason is not None:
            return index
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


def test_the_text_it_returns_is_the_reply_cut_before_the_stop_and_eos_stops_by_id():
    tokenizer = ByteTokenizer()
    rule = StopRule([0], ["END"], tokenizer)
    text = "".join(rule.take(token) for token in tokenizer.encode("one ENtwo END three"))
    assert rule.reason == "stop_string" and text + rule.finish() == "one ENtwo "
    eos = StopRule([0], None, tokenizer, text=True)
    pieces = [eos.take(token) for token in [*tokenizer.encode("hi"), 0]]
    assert eos.reason == "eos" and "".join(pieces) + eos.finish() == "hi\x00"
    assert StopRule([0], None, None).take(5) == ""  # no tokenizer: ids only
