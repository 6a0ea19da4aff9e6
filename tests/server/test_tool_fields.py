"""The tool fields of a chat body read and checked without a server: a bad tools, tool_choice or
parallel_tool_calls is a 400 naming the field (down to the tool and key), a replayed tool
conversation (an assistant's tool_calls, tool messages) is read for the chat template with each
call's arguments as an object, and a forced call gets its grammar."""

from __future__ import annotations

import pytest

from kvcache.server.openai_api import ApiError, Limits, read_call

LIMITS = Limits(max_prompt_tokens=100, max_tokens=50, default_max_tokens=16)
MESSAGES = [{"role": "user", "content": "weather?"}]
CITY = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": CITY}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _chat(**fields) -> dict:
    return {"messages": MESSAGES, **fields}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0]"),
    ({"tools": [TOOL, {"type": "function", "function": {"name": "bad name!"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
     "tools[0].function.returns"),
    ({"tools": [{**TOOL, "cache": True}]}, "tools[0].cache"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED}, "tool_choice"),
    ({"tools": [TOOL], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frog"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_a_bad_tool_field_is_a_400_naming_it(fields, param):
    with pytest.raises(ApiError) as raised:
        read_call("chat", _chat(**fields), LIMITS)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message


@pytest.mark.parametrize(("choice", "kind", "forced"), [
    (None, "auto", False), ("auto", "auto", False), ("none", "none", False), ("required", "required", True),
    (NAMED, "function", True),
])
def test_tool_choice_is_read_and_a_forced_call_gets_a_grammar(choice, kind, forced):
    call = read_call("chat", _chat(tools=[TOOL], tool_choice=choice), LIMITS)
    assert call.tools.choice == kind and call.tools.names == {"get_weather"}
    assert (call.params.structured is not None) == forced
    if forced:
        assert call.params.structured.kind == "grammar" and "<tool_call>" in call.params.structured.source


def test_no_tools_reads_as_before():
    assert read_call("chat", _chat(tools=[], tool_choice="none"), LIMITS).tools is None


def test_a_replayed_tool_conversation_is_read_with_arguments_as_objects():
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "-3 C"}]}]
    call = read_call("chat", {"messages": history, "tools": [TOOL]}, LIMITS)
    assert call.prompt[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]}
    assert call.prompt[2] == {"role": "tool", "tool_call_id": "c1", "content": "-3 C"}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": {"id": "c1"}}, "messages[1].tool_calls"),
    ({"role": "tool", "tool_call_id": 7, "content": "x"}, "messages[1].tool_call_id"),
    ({"role": "user", "content": "x", "tool_call_id": "c1"}, "messages[1].tool_call_id"),
    ({"role": "function", "name": "f", "content": "42"}, "messages[1]"),
])
def test_a_bad_tool_message_is_a_400_naming_it(message, param):
    with pytest.raises(ApiError) as raised:
        read_call("chat", {"messages": [*MESSAGES, message]}, LIMITS)
    assert raised.value.status == 400 and raised.value.param == param, raised.value.message
