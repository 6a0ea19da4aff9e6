"""The prefix-miss explainer remembers what the server holds after a reply (the prompt and the
reply's tokens), not only the prompts it saw: on the bundled model with forced replies, a next
turn that sends the reply back whole is a hit whose matched tokens cover the reply, and one whose
reply was changed partway is named where the change is, inside that reply's message."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, start_server
from forced_replies import force_replies

from kvcache.server import ServerSettings

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
REPLY = "The with statement opens a context and always closes it when its block ends, even on errors."


@pytest.fixture(scope="module")
def running(model, tokenizer):
    settings = ServerSettings(model_name="kvcache-test", api_key=API_KEY)
    found = force_replies(start_server(model, tokenizer, settings, max_running=4, token_budget=128), REPLY)
    yield found
    found.stop()


def ask(running, messages: list[dict]):
    client = openai.OpenAI(base_url=running.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    return client.chat.completions.create(model="kvcache-test", messages=messages, max_tokens=64,
                                          temperature=0)


def prefix_of(answer) -> dict:
    return answer.usage.model_extra["kvcache_prefix"]


def two_turns(running, question: str, sent_back: str):
    """The first turn's answer and the second's, whose history holds `sent_back` as the reply."""
    history = [{"role": "user", "content": question}]
    first = ask(running, history)
    assert first.choices[0].message.content == REPLY
    history += [{"role": "assistant", "content": sent_back}, {"role": "user", "content": "Show an example."}]
    return first, ask(running, history)


def test_a_reply_sent_back_whole_is_a_hit_whose_matched_tokens_cover_the_reply(running):
    first, second = two_turns(running, "What does the with statement do in Python?", REPLY)
    found = prefix_of(second)
    assert found["cause"] == "hit" and found["first_divergent_token"] is None
    # (against the first prompt alone the match would stop at its end)
    assert found["matched_tokens"] > first.usage.prompt_tokens + first.usage.completion_tokens // 2
    assert found["matched_tokens"] <= second.usage.prompt_tokens_details.cached_tokens  # (held: not the last)


def test_a_reply_changed_partway_is_named_inside_its_message(running, tokenizer):
    changed = REPLY.replace("always closes", "sometimes drops")
    first, second = two_turns(running, "What does a context manager do in Python?", changed)
    found = prefix_of(second)
    assert found["cause"] == "edited" and found["segment"] == "message 1"
    at = found["first_divergent_token"]
    assert first.usage.prompt_tokens < at == found["matched_tokens"]
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What does a context manager do in Python?"},
         {"role": "assistant", "content": changed}, {"role": "user", "content": "Show an example."}],
        add_generation_prompt=True)
    assert tokenizer.decode(prompt[at:]).lstrip().startswith("sometimes drops")


def test_a_reply_sent_back_without_the_reasoning_it_opened_with_is_named_at_the_reply(running):
    """The bundled template renders a history's assistant text as it is: a client that drops the
    reply's <think> block sends none of the reply's tokens, and is told so where the reply began."""
    running.reply = "<think>\nRecall the protocol first.\n</think>\n\n" + REPLY
    try:
        history = [{"role": "user", "content": "What does the with statement guarantee?"}]
        first = ask(running, history)
        history += [{"role": "assistant", "content": REPLY}, {"role": "user", "content": "Show an example."}]
        second = ask(running, history)
    finally:
        running.reply = REPLY
    found = prefix_of(second)
    assert (found["cause"], found["segment"]) == ("reasoning_rerendered", "message 1")
    assert found["first_divergent_token"] == found["matched_tokens"] == first.usage.prompt_tokens
