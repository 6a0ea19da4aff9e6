"""`--canonical-history`: a chat message that differs from one rendered before (after the same
history) only in whitespace or letter case, and tools sent in another order, are rendered in the
form first rendered. Unit: the forms kept and given back. Served on the bundled model (replies
forced): a history sent back whole submits the same tokens, answers and explanations with the
repair on as off; one sent back with its whitespace changed is a hit only with the repair on."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, start_server
from forced_replies import force_replies, recording_prompts

from kvcache.server import ServerSettings
from kvcache.server.canonical_history import CanonicalHistory

TIMEOUT = 60.0
REPLY = "Open the file with a context manager, then read its lines one at a time."
TOOLS = tuple({"type": "function", "function": {"name": name}} for name in ("read", "run"))
CHAT = [{"role": "system", "content": "You help with Python."},
        {"role": "user", "content": "How do I read a file  line by line?"}]


def test_a_form_rendered_first_is_given_back_for_its_cosmetic_variants():
    canonical = CanonicalHistory()
    assert canonical.messages(CHAT) is CHAT
    variant = [CHAT[0], {"role": "User", "content": "how do I read a file line by line? "}]
    assert canonical.messages(variant) == CHAT
    assert canonical.messages(CHAT) is CHAT  # (sent as first rendered: the same list)
    assert canonical.tools(TOOLS) is TOOLS and canonical.tools(TOOLS[::-1]) is TOOLS


def test_a_changed_text_or_history_is_not_a_variant():
    canonical = CanonicalHistory()
    canonical.messages(CHAT)
    edited = [CHAT[0], {"role": "user", "content": "How do I write a file line by line?"}]
    assert canonical.messages(edited) is edited
    other = [{"role": "system", "content": "You help with Rust."}, CHAT[1]]
    assert canonical.messages(other) is other  # (the same message after another history keeps its form)
    assert canonical.tools(TOOLS[:1]) == TOOLS[:1]


def test_capacity_is_bounded_and_checked():
    canonical = CanonicalHistory(capacity=2)
    for index in range(5):
        canonical.messages([{"role": "user", "content": f"question {index}"}])
    assert len(canonical) == 2
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        CanonicalHistory(capacity=0)


@pytest.fixture(scope="module")
def servers(model, tokenizer):
    """{'off': a server without the repair, 'on': one with it}, replies forced to REPLY, each
    keeping the prompt ids its engine was given (`running.prompts`)."""
    found = {}
    for name, canonical in (("off", False), ("on", True)):
        settings = ServerSettings(model_name="kvcache-test", api_key=API_KEY, canonical_history=canonical)
        started = start_server(model, tokenizer, settings, max_running=4, token_budget=128)
        found[name] = recording_prompts(force_replies(started, REPLY))
    yield found
    for running in found.values():
        running.stop()


def converse(running, sent_back) -> tuple[list, list[list[int]]]:
    """Two turns; the second's history holds sent_back(the first's messages and reply)."""
    client = openai.OpenAI(base_url=running.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    before, answers = len(running.prompts), []
    history = list(CHAT)
    for _ in range(2):
        answers.append(client.chat.completions.create(model="kvcache-test", messages=history, max_tokens=40,
                                                      temperature=0))
        reply = {"role": "assistant", "content": answers[-1].choices[0].message.content}
        history = sent_back(history + [reply])
        history.append({"role": "user", "content": "And in binary mode?"})
    return answers, running.prompts[before:]


def prefix_of(answer) -> dict:
    return answer.usage.model_extra["kvcache_prefix"]


@pytest.mark.kernels
@pytest.mark.processes
def test_a_history_sent_back_whole_submits_the_same_tokens_with_the_repair_on(servers):
    (off, off_prompts), (on, on_prompts) = (converse(servers[name], list) for name in ("off", "on"))
    assert on_prompts == off_prompts
    assert [a.choices[0].message.content for a in on] == [a.choices[0].message.content for a in off]
    assert [prefix_of(a) for a in on] == [prefix_of(a) for a in off]


@pytest.mark.kernels
@pytest.mark.processes
def test_a_history_sent_back_with_other_whitespace_is_a_hit_only_with_the_repair_on(servers):
    def squeezed(history: list[dict]) -> list[dict]:
        return [{**message, "content": " ".join(message["content"].split())} for message in history]

    for running in servers.values():  # (the conversation as first rendered, on both servers)
        converse(running, list)
    off, on = (converse(servers[name], squeezed)[0][1] for name in ("off", "on"))
    assert prefix_of(off)["cause"] == "normalisation"
    assert prefix_of(on)["cause"] == "hit"
    assert on.usage.prompt_tokens_details.cached_tokens > off.usage.prompt_tokens_details.cached_tokens
