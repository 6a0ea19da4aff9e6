"""The opt-in repair that puts a reply's reasoning back into a history a client sent without it
(kvcache.server.own_replies), on toy renders, no model: the restored prompt continues the server's
own (the prompt, then the reply as the model wrote it), turn after turn; and a history sent back as
the server made it (reasoning in the content, or as reasoning_content), a reply that had no
reasoning, or one whose block the prompt opened, is never changed, so a request that hit renders the
same tokens with the repair on."""

from __future__ import annotations

import pytest

from kvcache.server.own_replies import OwnReplies
from kvcache.server.reasoning import split_reasoning

SYSTEM = {"role": "system", "content": "You are an agent."}
THOUGHTS = ("<think>\nRead the file first.\n</think>\n\nReading it.", "<think>\n\n</think>\n\nDone.",
            "<think>Check the totals.</think>The totals are fine.")


def as_is(messages: list[dict]) -> str:
    """A template that renders each message's content as it is (the bundled model's way)."""
    text = "".join(f"<|{m['role']}|>\n{m.get('content') or ''}<|end|>\n" for m in messages)
    return text + "<|assistant|>\n"


def kept_after_think(messages: list[dict]) -> str:
    """A template that renders an assistant's content after its </think> only (Qwen3's way)."""
    return as_is([{**m, "content": (m.get("content") or "").split("</think>")[-1].lstrip("\n")}
                  if m["role"] == "assistant" else m for m in messages])


def conversation(own: OwnReplies, replies, send_back, variables=None) -> list[tuple[list[dict], str]]:
    """Turns of a chat: each request's history as `send_back(reply text)` makes the client's copy of
    the server's replies, restored by `own`, then the server's reply remembered as app.py does.
    Returns each turn's (restored messages, reply text)."""
    variables = variables or {}
    history, turns = [SYSTEM], []
    for step, text in enumerate(replies):
        history = [*history, {"role": "user", "content": f"Step {step}, please."}]
        sent = own.restore(history, variables)
        reasoning, content = split_reasoning(text, False)
        own.remember(sent, variables, text, False, content)
        turns.append((sent, text))
        history = [*history, send_back(text)]
    return turns


def dropped(text: str) -> dict:
    return {"role": "assistant", "content": split_reasoning(text, False)[1]}


def test_a_reply_sent_back_without_its_reasoning_gets_it_back_turn_after_turn():
    """Each turn's prompt begins with the previous turn's prompt and the reply as the model wrote it:
    the whole earlier sequence is a prefix hit."""
    turns = conversation(OwnReplies(), THOUGHTS, dropped)
    for (before, reply), (after, _) in zip(turns, turns[1:]):
        assert as_is(after).startswith(as_is(before) + reply)


def test_without_the_repair_the_dropped_reasoning_parts_the_prompts():
    turns = conversation(OwnReplies(), THOUGHTS, dropped)
    plain = [SYSTEM, turns[0][0][1], dropped(THOUGHTS[0]), turns[1][0][-1]]
    assert not as_is(plain).startswith(as_is(turns[0][0]) + THOUGHTS[0])
    assert as_is(turns[1][0]).startswith(as_is(turns[0][0]) + THOUGHTS[0])


@pytest.mark.parametrize("send_back", [
    lambda text: {"role": "assistant", "content": text},  # a server that does not split: content whole
    lambda text: {"role": "assistant", "content": split_reasoning(text, False)[1],
                  "reasoning_content": split_reasoning(text, False)[0]},  # split, sent back whole
], ids=["content-whole", "reasoning_content"])
def test_a_history_sent_back_as_the_server_made_it_is_never_changed(send_back):
    own = OwnReplies()
    for sent, _ in conversation(own, THOUGHTS, send_back):
        assert own.restore(sent, {}) is sent
    assert len(own) == len(THOUGHTS)


def test_a_reply_without_reasoning_or_whose_block_the_prompt_opened_is_not_remembered():
    own = OwnReplies()
    conversation(own, ["Plain answer.", "Another plain one."], dropped)
    own.remember([SYSTEM], {}, "Read it.\n</think>\n\nReading.", True, "Reading.")
    assert len(own) == 0


def test_a_template_that_drops_reasoning_itself_renders_the_same_tokens_restored_or_not():
    own = OwnReplies()
    for sent, _ in conversation(own, THOUGHTS, dropped):
        plain = [m if m["role"] != "assistant" else dropped(m["content"]) for m in sent]
        assert kept_after_think(sent) == kept_after_think(plain)


def test_only_the_same_history_and_template_variables_find_a_reply():
    own = OwnReplies()
    tools = {"tools": [{"type": "function", "function": {"name": "read_file"}}]}
    (first, reply), = conversation(own, THOUGHTS[:1], dropped, tools)
    later = [*first, dropped(reply), {"role": "user", "content": "next"}]
    assert own.restore(later, {}) is later  # other variables
    edited = [{**SYSTEM, "content": "You are another agent."}, *later[1:]]
    assert own.restore(edited, tools) is edited  # another history before the reply
    assert own.restore(later, tools)[2]["content"] == reply


def test_a_tool_call_reply_gets_its_reasoning_back_before_the_call():
    own = OwnReplies()
    asked = [SYSTEM, {"role": "user", "content": "Fix it."}]
    text = '<think>Look first.</think>\n\n<tool_call>\n{"name": "read_file"}\n</tool_call>'
    own.remember(asked, {}, text, False, None)
    call = {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function"}]}
    restored = own.restore([*asked, call, {"role": "tool", "content": "ok"}], {})
    assert restored[2] == {**call, "content": "<think>Look first.</think>\n\n"}


def test_the_record_is_bounded_and_a_bad_capacity_names_itself():
    own = OwnReplies(capacity=2)
    conversation(own, THOUGHTS, dropped)
    assert len(own) == 2
    with pytest.raises(ValueError, match="capacity"):
        OwnReplies(0)


def test_a_reply_the_server_did_not_split_is_keyed_by_its_content_after_the_block():
    """Where the template writes no reasoning markers the client is sent the whole text, and a
    client that drops reasoning cuts the block off itself."""
    own = OwnReplies()
    asked = [SYSTEM, {"role": "user", "content": "Go."}]
    own.remember(asked, {}, THOUGHTS[0], False, THOUGHTS[0])
    assert own.restore([*asked, dropped(THOUGHTS[0])], {})[2]["content"] == THOUGHTS[0]
