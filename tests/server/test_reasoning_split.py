"""The reasoning splitter (kvcache.server.reasoning) alone: a `<think>` block's text goes to
reasoning and the rest to content, the same whether the reply comes whole or in pieces cut
anywhere (markers split across pieces), a block left open is all reasoning, and a reply with no
block is its content unchanged."""

from __future__ import annotations

import itertools

import pytest

from kvcache.server.reasoning import ReasoningStream, opens_in_reasoning, reasoning_format, split_reasoning

CASES = [  # (reply, started by the prompt, reasoning, content)
    ("<think>\nI should greet.\n</think>\n\nHello there", False, "I should greet.", "Hello there"),
    ("  <think>a\nb</think>Hi", False, "a\nb", "Hi"),
    ("I should greet.\n</think>\n\nHello", True, "I should greet.", "Hello"),
    ("<think>\nstill thinking, cut by max_tokens", False, "still thinking, cut by max_tokens", ""),
    ("half a </thi", True, "half a </thi", ""),
    ("<think>\n\n</think>\n\nJust the answer", False, "", "Just the answer"),
    ("Hello <think>not a block</think>", False, None, "Hello <think>not a block</think>"),
    ("  plain answer\n", False, None, "  plain answer\n"),
    ("<thin", False, None, "<thin"),
    ("", False, None, ""),
]


@pytest.mark.parametrize(("reply", "started", "reasoning", "content"), CASES)
def test_a_whole_reply_splits_into_reasoning_and_content(reply, started, reasoning, content):
    assert split_reasoning(reply, started) == (reasoning, content)


def _streamed(pieces: list[str], started: bool) -> tuple[str, str]:
    stream = ReasoningStream(started)
    reasoning = content = ""
    for piece in pieces:
        more_reasoning, more_content = stream.feed(piece)
        assert not (more_content and stream.state != "content")  # (content only once it is known)
        reasoning, content = reasoning + more_reasoning, content + more_content
    rest_reasoning, rest_content = stream.finish()
    return reasoning + rest_reasoning, content + rest_content


@pytest.mark.parametrize(("reply", "started", "reasoning", "content"), CASES)
def test_a_streamed_reply_cut_anywhere_splits_as_the_whole_one(reply, started, reasoning, content):
    for first, second in itertools.combinations_with_replacement(range(len(reply) + 1), 2):
        pieces = [reply[:first], reply[first:second], reply[second:]]
        assert _streamed(pieces, started) == (reasoning or "", content), pieces
    assert _streamed(list(reply), started) == (reasoning or "", content)  # a character a piece


def test_reasoning_goes_out_before_the_block_closes_and_a_partial_marker_is_held():
    stream = ReasoningStream(started=False)
    assert stream.feed("<th") == ("", "")
    assert stream.feed("ink>\nStep one") == ("Step one", "")
    assert stream.feed(". </thi") == (". ", "")  # "</thi" may begin </think>: held
    assert stream.feed("nk>\n\nAns") == ("", "Ans")
    assert stream.feed("wer") == ("", "wer")
    assert stream.finish() == ("", "")


def test_a_template_with_think_markers_is_of_the_think_family_and_its_open_prompt_is_seen():
    assert reasoning_format("{{ content.split('</think>')[-1] }}") == "think"
    assert reasoning_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert reasoning_format(None) is None
    assert opens_in_reasoning("<|assistant|>\n<think>\n")
    assert not opens_in_reasoning("<|assistant|>\n<think>\n\n</think>\n\n")
    assert not opens_in_reasoning("<|assistant|>\n")
