"""Reasoning through the server and the official `openai` client, on the bundled model served with a
chat template that writes Qwen3's reasoning markers (tests/server/think.jinja): a reply's
`<think>` block comes as `message.reasoning_content` (streamed: `reasoning_content` deltas before
the content's), a block the prompt opened (DeepSeek-R1's way) too, a reply without one is its
content unchanged; `chat_template_kwargs` reach the template (`enable_thinking`) and the token
routes render them as the chat route does; the next turn, sending back the content, still finds
the earlier turn's blocks. The replies are forced by a Lark grammar the test puts on each
submitted request (the tiny model writes no reasoning of its own)."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY
from forced_replies import force_replies, templated_server

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
TEMPLATE = Path(__file__).resolve().parent / "think.jinja"
QUESTION = [{"role": "user", "content": "Say hello."}]
THOUGHT = "<think>\nI should greet.\n</think>\n\nHello there"


@pytest.fixture(scope="module")
def think_server(model, tokenizer):
    running = force_replies(templated_server(model, tokenizer, TEMPLATE.read_text(encoding="utf-8")), THOUGHT)
    yield running
    running.stop()


@pytest.fixture
def client(think_server):
    think_server.reply = THOUGHT
    return openai.OpenAI(base_url=think_server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def _ask(client, messages=QUESTION, **options):
    return client.chat.completions.create(**{"model": "kvcache-test", "messages": messages, "max_tokens": 80,
                                             "temperature": 0, **options})


def test_a_think_block_is_the_reasoning_content_and_the_rest_the_content(client):
    message = _ask(client).choices[0].message
    assert message.reasoning_content == "I should greet."
    assert message.content == "Hello there"


def test_streamed_reasoning_comes_as_deltas_before_the_contents(client):
    kinds, reasoning, content = [], "", ""
    for chunk in _ask(client, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            if delta.get("reasoning_content"):
                kinds.append("reasoning")
                reasoning += delta["reasoning_content"]
            if delta.get("content"):
                kinds.append("content")
                content += delta["content"]
    assert (reasoning, content) == ("I should greet.", "Hello there")
    assert kinds.index("content") > len(kinds) - kinds[::-1].index("reasoning") - 1  # (every reasoning first)
    assert kinds.count("reasoning") > 1  # streamed as it came, not held to the end


def test_a_block_the_prompt_opened_is_split_too(client, think_server):
    think_server.reply = "I should greet.\n</think>\n\nHello there"
    message = _ask(client, extra_body={"chat_template_kwargs": {"think_in_prompt": True}}).choices[0].message
    assert (message.reasoning_content, message.content) == ("I should greet.", "Hello there")


def test_a_reply_without_a_block_is_its_content_unchanged(client, think_server):
    think_server.reply = "Hello <think>there</think>"
    message = _ask(client).choices[0].message
    assert message.content == "Hello <think>there</think>"
    assert "reasoning_content" not in message.model_dump(exclude_none=True)


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=TIMEOUT)


def test_chat_template_kwargs_reach_the_template_on_every_route(client, think_server):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    prompt = _post(think_server, "/apply-template", {"messages": QUESTION, **off}).json()["prompt"]
    assert prompt.endswith("<|assistant|>\n<think>\n\n</think>\n\n")
    count = _post(think_server, "/tokenize", {"messages": QUESTION, **off}).json()["count"]
    think_server.reply = "Hello there"
    reply = _ask(client, extra_body=off)
    assert reply.usage.prompt_tokens == count > _ask(client).usage.prompt_tokens
    assert reply.choices[0].message.content == "Hello there"


@pytest.mark.parametrize(("value", "param"), [([1], "chat_template_kwargs"),
                                              ({"add_generation_prompt": False},
                                               "chat_template_kwargs.add_generation_prompt")])
def test_bad_chat_template_kwargs_are_a_400_naming_them(client, value, param):
    with pytest.raises(openai.BadRequestError) as raised:
        _ask(client, extra_body={"chat_template_kwargs": value})
    assert raised.value.param == param


def test_the_next_turn_sending_back_the_content_finds_the_earlier_turns_blocks(client):
    first = _ask(client, [{"role": "user", "content": "Say hello, once more, for the cache."}])
    reply = first.choices[0].message
    assert reply.reasoning_content == "I should greet."
    history = [{"role": "user", "content": "Say hello, once more, for the cache."},
               reply.model_dump(exclude_none=True),  # (its reasoning_content too: taken)
               {"role": "user", "content": "And goodbye?"}]
    second = _ask(client, history)
    block = 8  # (the test engine's block size)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // block * block > 0


def test_each_of_n_streamed_choices_has_its_reasoning_split_under_its_index(client):
    reasoning, content = ["", ""], ["", ""]
    for chunk in _ask(client, stream=True, n=2):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning[choice.index] += delta.get("reasoning_content") or ""
            content[choice.index] += delta.get("content") or ""
    assert reasoning == ["I should greet."] * 2 and content == ["Hello there"] * 2
    whole = _ask(client, n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in whole.choices] == [
        ("I should greet.", "Hello there")] * 2
