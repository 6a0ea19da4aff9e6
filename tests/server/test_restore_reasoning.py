"""`--restore-reasoning` through the server on the bundled model, whose chat template renders an
assistant's content as it is and writes no reasoning markers (a reply's `<think>` block comes back
in its content); replies forced by a grammar. With the repair on, a client that drops the reasoning
from the history gets a prompt that continues the server's own sequence (a `hit` where it was
`reasoning_rerendered`); requests that send the history back whole submit the same tokens, and get
the same answers and explanations, with the repair on as off."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, start_server
from forced_replies import force_replies, recording_prompts

from kvcache.server import ServerSettings
from kvcache.server.reasoning import split_reasoning

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
THOUGHT = "<think>\nCount the letters first.\n</think>\n\nThere are five of them"
TURNS = 3


@pytest.fixture(scope="module")
def servers(model, tokenizer):
    """{'off': a server without the repair, 'on': one with it}, each forcing THOUGHT as every reply
    and keeping the prompt ids its engine was given (`running.prompts`)."""
    found = {}
    for name, restore in (("off", False), ("on", True)):
        settings = ServerSettings(model_name="kvcache-test", api_key=API_KEY, restore_reasoning=restore)
        found[name] = recording_prompts(force_replies(
            start_server(model, tokenizer, settings, max_running=4, token_budget=128), THOUGHT))
    yield found
    for running in found.values():
        running.stop()


def converse(running, question: str, send_back) -> tuple[list, list[list[int]], list[dict]]:
    """TURNS turns of a chat, each reply sent back as send_back(its content) makes it: the answers,
    the prompt ids the engine was given, and the history."""
    client = openai.OpenAI(base_url=running.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    before, history, answers = len(running.prompts), [], []
    for step in range(TURNS):
        history.append({"role": "user", "content": f"{question} Step {step}."})
        answer = client.chat.completions.create(model="kvcache-test", messages=history, max_tokens=80,
                                                temperature=0)
        answers.append(answer)
        history.append(send_back(answer.choices[0].message.content))
    return answers, running.prompts[before:], history


def whole(content: str) -> dict:
    return {"role": "assistant", "content": content}


def dropped(content: str) -> dict:
    return {"role": "assistant", "content": split_reasoning(content, False)[1]}


def prefix_of(answer) -> dict:
    return answer.usage.model_extra["kvcache_prefix"]


def test_a_history_sent_back_whole_submits_the_same_tokens_with_the_repair_on(servers, tokenizer):
    runs = {name: converse(running, "How many vowels are in 'queue'?", whole)
            for name, running in servers.items()}
    (off, off_prompts, history), (on, on_prompts, _) = runs["off"], runs["on"]
    assert on_prompts == off_prompts
    assert on_prompts[-1] == list(tokenizer.apply_chat_template(history[:-1], add_generation_prompt=True))
    assert [a.choices[0].message.content for a in on] == [a.choices[0].message.content for a in off]
    assert [prefix_of(a) for a in on] == [prefix_of(a) for a in off]
    assert [prefix_of(a)["cause"] for a in on[1:]] == ["hit"] * (TURNS - 1)


def reused(answers) -> list[tuple[int, int]]:
    """Each later turn's (cached tokens, the earlier turn's prompt and reply tokens in whole blocks:
    what a prompt continuing that sequence could take from the cache)."""
    block = 8  # (the test engine's)
    return [(later.usage.prompt_tokens_details.cached_tokens,
             (earlier.usage.prompt_tokens + earlier.usage.completion_tokens - 1) // block * block)
            for earlier, later in zip(answers, answers[1:])]


def test_a_history_without_the_reasoning_gets_it_back_and_reuses_the_reply(servers, tokenizer):
    question = "How many consonants are in 'rhythm'?"
    off, _, _ = converse(servers["off"], question, dropped)
    on, prompts, history = converse(servers["on"], question, dropped)
    assert all(cached < could for cached, could in reused(off))  # the reply's blocks not reused
    assert all(cached >= could for cached, could in reused(on))
    assert [prefix_of(a)["cause"] for a in on[1:]] == ["hit"] * (TURNS - 1)
    assert on[-1].choices[0].message.content == THOUGHT
    restored = [whole(THOUGHT) if message["role"] == "assistant" else message for message in history[:-1]]
    assert prompts[-1] == list(tokenizer.apply_chat_template(restored, add_generation_prompt=True))
