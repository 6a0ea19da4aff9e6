"""Tool calls through the server and the official `openai` client, on the bundled model served with
Qwen2.5's chat template (tests/text/qwen25_tools.jinja: it renders tools and `<tool_call>` blocks):
an agent loop (question -> a call forced by tool_choice -> the tool's result -> an answer), a
named function's call holding to its parameters, streamed tool_calls deltas, and the bundled
model's own template (which renders no tools) answering a 400 naming tools."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from conftest import API_KEY
from forced_replies import QUESTION, TIME, WEATHER, templated_server

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
TEMPLATE = Path(__file__).resolve().parents[1] / "text" / "qwen25_tools.jinja"


@pytest.fixture(scope="module")
def tool_server(model, tokenizer):
    running = templated_server(model, tokenizer, TEMPLATE.read_text(encoding="utf-8"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(tool_server):
    return openai.OpenAI(base_url=tool_server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def _ask(client, messages, **options):
    return client.chat.completions.create(**{"model": "kvcache-test", "messages": messages, "max_tokens": 60,
                                             "temperature": 0, "tools": [WEATHER, TIME], **options})


def test_an_agent_loop_calls_a_tool_reads_its_result_and_answers(client):
    first = _ask(client, QUESTION, tool_choice="required", parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, sorted(arguments)) in [("get_weather", ["city"]), ("get_time", ["zone"])]
    history = [*QUESTION, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "21 C and sunny"}]
    answer = _ask(client, history, tool_choice="none", max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0  # the earlier turn's blocks found
    # (the prompt parts where the earlier one ended: the assistant's call, measured with the tools)
    assert answer.usage.kvcache_prefix["segment"] == "message 1"


def test_a_named_function_is_called_with_arguments_of_its_schema(client):
    reply = _ask(client, QUESTION, tool_choice={"type": "function", "function": {"name": "get_time"}})
    calls = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert [call.function.name for call in calls] == ["get_time"] * len(calls)
    assert all(json.loads(call.function.arguments)["zone"] in ("UTC", "CET") for call in calls)


def test_streamed_tool_calls_come_as_deltas_that_join_into_the_calls(client):
    stream = _ask(client, QUESTION, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  stream=True)
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in stream:
        for choice in chunk.choices:
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
    assert reasons[-1] == "tool_calls" and calls
    assert all(entry["name"] == "get_weather" and json.loads(entry["arguments"])["city"] in ("Paris", "Oslo")
               for entry in calls.values())


def test_tools_on_a_template_that_renders_none_are_a_400_naming_tools(server):
    client = openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="kvcache-test", messages=QUESTION, max_tokens=4, tools=[WEATHER])
    assert raised.value.param == "tools" and "<tool_call>" in raised.value.message
    rendered = _post(server, "/apply-template", {"messages": QUESTION, "tools": [WEATHER]})
    assert rendered.status_code == 400 and rendered.json()["error"]["param"] == "tools"


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=TIMEOUT)


def test_the_token_routes_render_tools_as_the_chat_route_does(tool_server, client):
    rendered = _post(tool_server, "/apply-template", {"messages": QUESTION, "tools": [WEATHER, TIME]})
    assert rendered.status_code == 200 and json.dumps(WEATHER) in rendered.json()["prompt"]
    tokens = _post(tool_server, "/tokenize", {"messages": QUESTION, "tools": [WEATHER, TIME]}).json()["count"]
    asked = _ask(client, QUESTION, max_tokens=1)
    assert asked.usage.prompt_tokens == tokens
