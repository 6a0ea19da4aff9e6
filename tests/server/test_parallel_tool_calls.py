"""Parallel tool calls in Qwen2.5's (hermes) format through the server and the official `openai`
client, on the bundled model served with Qwen2.5's template and a reply the test forces: two
`<tool_call>` blocks come back as two tool_calls (indices 0 and 1, ids of their own), whole and as
streamed deltas; the agent loop's next turn, both results sent back as `tool` messages, finds the
first turn's blocks (cached_tokens > 0)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from conftest import API_KEY
from forced_replies import QUESTION, TIME, WEATHER, force_replies, templated_server

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
TEMPLATE = Path(__file__).resolve().parents[1] / "text" / "qwen25_tools.jinja"
TWO_CALLS = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
EXPECTED = [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]


@pytest.fixture(scope="module")
def forced_server(model, tokenizer):
    running = force_replies(templated_server(model, tokenizer, TEMPLATE.read_text(encoding="utf-8")))
    yield running
    running.stop()


@pytest.fixture
def client(forced_server):
    forced_server.reply = TWO_CALLS
    return openai.OpenAI(base_url=forced_server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def _ask(client, messages, **options):
    return client.chat.completions.create(**{"model": "kvcache-test", "messages": messages, "max_tokens": 250,
                                             "temperature": 0, "tools": [WEATHER, TIME], **options})


def test_two_calls_in_one_reply_come_back_as_two_tool_calls_with_their_own_ids(client):
    choice = _ask(client, QUESTION, parallel_tool_calls=True).choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == EXPECTED
    assert len({call.id for call in calls}) == 2 and all(call.type == "function" for call in calls)


def test_two_streamed_calls_come_as_deltas_under_indices_0_and_1(client):
    calls: dict[int, dict] = {}
    reasons, content = [], ""
    for chunk in _ask(client, QUESTION, stream=True):
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"ids": set(), "name": "", "arguments": ""})
                entry["ids"] |= {delta.id} - {None}
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and content == "" and sorted(calls) == [0, 1]
    assert [(calls[index]["name"], json.loads(calls[index]["arguments"])) for index in (0, 1)] == EXPECTED
    assert all(len(calls[index]["ids"]) == 1 for index in (0, 1)) and calls[0]["ids"] != calls[1]["ids"]


def test_both_results_sent_back_find_the_first_turns_blocks(client, forced_server):
    first = _ask(client, QUESTION).choices[0].message
    results = {"get_weather": "4 C and clear", "get_time": "21:40"}
    history = [*QUESTION, first.model_dump(exclude_none=True),
               *({"role": "tool", "tool_call_id": call.id, "content": results[call.function.name]}
                 for call in first.tool_calls)]
    forced_server.reply = "It is 4 C and clear in Oslo, and 21:40 CET."
    answer = _ask(client, history, tool_choice="none", max_tokens=120)
    assert answer.choices[0].message.content == forced_server.reply
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0
