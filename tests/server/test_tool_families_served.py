"""Tool calls of the mistral and llama3 families through the server and the official `openai` client,
on the bundled model served with a small template of each family (tests/text/mistral_tools.jinja,
llama3_tools.jinja): a forced call (tool_choice) comes back as tool_calls, streamed as deltas; a
reply the test forces in the family's format is read back (content beside mistral's calls, several
calls; whole and streamed); and the agent loop's next turn (the call and its result replayed) finds
the first turn's blocks cached up to the call (llama3's; Mistral's template moves the tools to the
last user turn)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from conftest import API_KEY
from forced_replies import QUESTION, TIME, WEATHER, force_replies, templated_server

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
TEXT = Path(__file__).resolve().parents[1] / "text"


@pytest.fixture(scope="module", params=["mistral", "llama3"])
def family_server(request, model, tokenizer):
    template = (TEXT / f"{request.param}_tools.jinja").read_text(encoding="utf-8")
    running = force_replies(templated_server(model, tokenizer, template))
    running.family = request.param
    yield running
    running.stop()


@pytest.fixture
def client(family_server):
    family_server.reply = None
    return family_server.family, openai.OpenAI(base_url=family_server.url, api_key=API_KEY, timeout=TIMEOUT,
                                               max_retries=0)


def _ask(client, messages, **options):
    return client.chat.completions.create(**{"model": "kvcache-test", "messages": messages, "max_tokens": 90,
                                             "temperature": 0, "tools": [WEATHER, TIME], **options})


def test_a_forced_call_comes_back_as_tool_calls_and_the_next_turn_finds_it_cached(client):
    family, client = client
    first = _ask(client, QUESTION, tool_choice="required", parallel_tool_calls=False, logprobs=True)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    written = "".join(token.token for token in choice.logprobs.content)  # (the reply as the model wrote it)
    assert written.startswith('[TOOL_CALLS] [{"name": "' if family == "mistral" else '{"name": "')
    call = choice.message.tool_calls[0]
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, sorted(arguments)) in [("get_weather", ["city"]), ("get_time", ["zone"])]
    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    answer = _ask(client, history, tool_choice="none", max_tokens=4)
    assert answer.choices[0].message.tool_calls is None
    if family == "llama3":  # (Mistral's template moves the tools to the last user turn)
        assert answer.usage.kvcache_prefix["segment"] == "message 1"  # (found up to the assistant's call)


def test_a_named_function_streams_as_deltas_that_join_into_its_call(client):
    _, client = client
    stream = _ask(client, QUESTION, tool_choice={"type": "function", "function": {"name": "get_time"}},
                  stream=True)
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and content == "" and len(calls) == 1
    assert calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"])["zone"] in ("UTC", "CET")


REPLIES = {  # (the reply forced by the test, what goes out as content, the calls)
    "mistral": ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]', "Let me check.",
                [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    "llama3": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', None,
               [("get_weather", {"city": "Oslo"})]),
}


def test_a_reply_in_the_family_is_read_back_whole_and_streamed(client, family_server):
    family, client = client
    family_server.reply, content, expected = REPLIES[family]
    message = _ask(client, QUESTION).choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content == content
    assert [(call.function.name, json.loads(call.function.arguments))
            for call in message.message.tool_calls] == expected
    sent, calls = "", {}
    for chunk in _ask(client, QUESTION, stream=True):
        for choice in chunk.choices:
            sent += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                calls[delta.index] = (delta.function.name, json.loads(delta.function.arguments))
    assert sent.strip() == (content or "") and [calls[index] for index in sorted(calls)] == expected
