"""`kvcache serve --chat-template FILE` as a process, on the bundled model with Qwen2.5's template
(it renders tools): an agent loop through the official `openai` client, question -> a call forced
by tool_choice -> the tool's result -> an answer; a template file jinja cannot compile is a start-up
error naming --chat-template."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from serve_process import start_serve, stop_serve

from kvcache.cli import main

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
TEMPLATE = Path(__file__).resolve().parents[1] / "text" / "qwen25_tools.jinja"
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "description": "Look a word up in the Python docs.",
    "parameters": {"type": "object", "properties": {"word": {"enum": ["class", "def", "with"]}},
                   "required": ["word"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def client():
    process, base = start_serve("--chat-template", str(TEMPLATE))
    try:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    finally:
        if process.poll() is None:
            stop_serve(process)


def test_an_agent_loop_through_the_openai_client_against_kvcache_serve(client):
    messages = [{"role": "user", "content": "What does the with statement do?"}]
    ask = {"model": None, "max_tokens": 120, "temperature": 0, "tools": [LOOKUP]}
    ask["model"] = client.models.list().data[0].id
    first = client.chat.completions.create(messages=messages, tool_choice="required",
                                           parallel_tool_calls=False, **ask)
    assert first.choices[0].finish_reason == "tool_calls"
    call = first.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup" and json.loads(call.function.arguments)["word"] in LOOKUP[
        "function"]["parameters"]["properties"]["word"]["enum"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "It runs a block inside a context."}]
    answer = client.chat.completions.create(messages=messages, tool_choice="none", **{**ask, "max_tokens": 6})
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    assert answer.usage.prompt_tokens_details.cached_tokens > 0


def test_a_chat_template_jinja_cannot_compile_is_named(tmp_path, capsys):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}")
    assert main(["serve", "--port", "0", "--chat-template", str(broken)]) == 2
    assert "--chat-template" in capsys.readouterr().err
