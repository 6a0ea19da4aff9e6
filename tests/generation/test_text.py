"""ReplyText: the pieces joined equal the decoded reply, cut before the first stop string, with
no piece holding a broken character, whatever the token boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcache
from kvcache.generation.text import ReplyText


@pytest.fixture(scope="module")
def tokenizer():
    return kvcache.load_tokenizer()


def _pieces(tokenizer, ids, stop=()):
    text = ReplyText(tokenizer, stop)
    pieces = [text.add(token) for token in ids]
    pieces.append(text.finish())
    return pieces


@settings(max_examples=60, deadline=None)
@given(
    words=st.lists(st.sampled_from(["class", " def", "é", "—", " 猫", "\n", "ü", "🙂", " x"]), max_size=30)
)
def test_the_pieces_joined_are_the_decoded_text(tokenizer, words):
    ids = tokenizer.encode("".join(words), add_special_tokens=False)
    pieces = _pieces(tokenizer, ids)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])


@settings(max_examples=60, deadline=None)
@given(
    before=st.text(alphabet="ab c\né", max_size=30),
    stop=st.sampled_from(["STOP", "\n\n", "c d", "é"]),
    after=st.text(alphabet="ab c\né", max_size=10),
)
def test_the_reply_is_cut_before_the_first_stop_string(tokenizer, before, stop, after):
    ids = tokenizer.encode(before + stop + after, add_special_tokens=False)
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    streamed = "".join(_pieces(tokenizer, ids, (stop, "never there")))
    assert streamed == decoded[: decoded.find(stop)] if stop in decoded else decoded


def test_nothing_is_released_that_a_stop_string_could_still_take_back(tokenizer):
    text = ReplyText(tokenizer, ("END",))
    released = ""
    for token in tokenizer.encode("one two EN", add_special_tokens=False):
        released += text.add(token)
    assert "EN" not in released and released.startswith("one")
    for token in tokenizer.encode("D three", add_special_tokens=False):
        released += text.add(token)
    released += text.finish()
    assert released == "one two "


@pytest.mark.parametrize("text", ["ok 🙂", "猫", "a é"])
def test_a_reply_cut_inside_a_character_ends_without_a_replacement_character(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    cut = ids[:-1]  # max_tokens reached with the last character's bytes incomplete
    assert tokenizer.decode(cut, skip_special_tokens=True).endswith("\ufffd")  # (what a decoder gives)
    reply = ReplyText(tokenizer)
    pieces = [reply.add(token) for token in cut] + [reply.finish()]
    whole = tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(pieces) == reply.text == whole[: len(whole) - 1]  # the half character held back
