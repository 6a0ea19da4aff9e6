"""Nothing a client sends is silently ignored: a field kvcache does not implement is a 400 naming
it, a field it reads only at its default is refused at any other value, a legacy function message
is refused naming the message, and only the documented few fields are accepted and ignored
(each of which cannot change the answer). docs/serve.md lists every field and route the server
takes, and says which it accepts and ignores."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvcache.server.openai_api import ApiError, Limits, read_call

LIMITS = Limits(max_prompt_tokens=100, max_tokens=50, default_max_tokens=16)
MESSAGES = [{"role": "user", "content": "hi"}]
SERVE_MD = Path(__file__).resolve().parents[2] / "docs" / "serve.md"
BODIES = {"chat": {"model": "m", "messages": MESSAGES}, "completion": {"model": "m", "prompt": "x"}}

#: the accepted-and-ignored list, as docs/serve.md gives it (each tags, bills, stores or routes
#: the request)
IGNORED = {"user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k", "metadata": {"a": "b"},
           "store": True, "service_tier": "auto", "cache_prompt": True}

REFUSED = [
    ("chat", "functions", [{"name": "f", "parameters": {}}]),
    ("chat", "function_call", {"name": "f"}),
    ("chat", "modalities", ["text", "audio"]),
    ("chat", "audio", {"voice": "alloy", "format": "wav"}),
    ("chat", "reasoning_effort", "low"),
    ("chat", "prediction", {"type": "content", "content": "x"}),
    ("chat", "web_search_options", {}),
    ("chat", "prompt", "x"),
    ("chat", "echo", True),
    ("chat", "stream_options.continuous_usage_stats", True),
    ("completion", "suffix", " and so on"),
    ("completion", "echo", True),
    ("completion", "best_of", 3),
    ("completion", "chat_template_kwargs", {"enable_thinking": False}),
    ("completion", "messages", MESSAGES),
    ("completion", "frobnicate", 1),
    ("completion", "min_tokens", 4),
    ("completion", "tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("completion", "parallel_tool_calls", False),
]


def _with(kind: str, field: str, value) -> dict:
    if field.startswith("stream_options."):
        return {**BODIES[kind], "stream_options": {field.split(".", 1)[1]: value}}
    return {**BODIES[kind], field: value}


@pytest.mark.parametrize(("kind", "field", "value"), REFUSED)
def test_a_field_kvcache_does_not_implement_is_a_400_naming_it(kind, field, value):
    with pytest.raises(ApiError) as raised:
        read_call(kind, _with(kind, field, value), LIMITS)
    assert raised.value.status == 400 and raised.value.param == field
    assert f"{field}" in raised.value.message and "not supported by this server (yet)" in raised.value.message


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_only_the_documented_fields_are_accepted_and_ignored_and_they_change_nothing(kind):
    from kvcache.server.fields import IGNORED as ignored

    assert set(ignored) == set(IGNORED) and all(ignored.values())  # (each with its reason)
    plain = read_call(kind, BODIES[kind], LIMITS)
    for field, value in IGNORED.items():
        assert read_call(kind, {**BODIES[kind], field: value}, LIMITS) == plain, field
    options = {**BODIES[kind], "stream_options": {"include_usage": True, "include_obfuscation": False}}
    assert read_call(kind, options, LIMITS).include_usage


@pytest.mark.parametrize(("kind", "defaults"), [
    ("chat", {"n": 1, "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
              "tools": [], "tool_choice": "none", "functions": [], "function_call": "auto",
              "modalities": ["text"]}),
    ("chat", {"n": None, "logprobs": None, "response_format": None, "tools": None, "tool_choice": "auto"}),
    ("completion", {"n": 1, "best_of": 1, "logprobs": None, "echo": False, "suffix": None}),
])
def test_a_field_read_only_at_its_default_takes_its_default(kind, defaults):
    assert read_call(kind, {**BODIES[kind], **defaults}, LIMITS) == read_call(kind, BODIES[kind], LIMITS)


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([*MESSAGES, {"role": "function", "name": "f", "content": "42"}], "messages[1]", "tool calls"),
    ([{"role": "user", "content": "hi", "name": "ann"}], "messages[0].name", "role and content"),
])
def test_a_function_message_or_a_dropped_message_key_is_a_400_naming_it(messages, param, words):
    with pytest.raises(ApiError) as raised:
        read_call("chat", {"messages": messages}, LIMITS)
    assert raised.value.param == param and words in raised.value.message
    assert "not supported by this server (yet)" in raised.value.message


def test_a_replayed_reply_with_its_null_fields_is_read_as_role_and_content():
    reply = {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None,
             "function_call": None, "audio": None, "annotations": []}
    call = read_call("chat", {"messages": [*MESSAGES, reply, *MESSAGES]}, LIMITS)
    assert call.prompt[1] == {"role": "assistant", "content": "hello"}



def test_docs_serve_lists_every_field_and_route_and_which_are_ignored():
    from kvcache.server.app import ROUTES_SAID
    from kvcache.server.fields import DEFAULT_ONLY, IGNORED_STREAM_OPTIONS, READ
    from kvcache.server.fields import IGNORED as ignored

    rows = dict(re.findall(r"^\| `([^`]+)` \|(.*)$", SERVE_MD.read_text(encoding="utf-8"), re.MULTILINE))
    taken_ignored = set(ignored) | {f"stream_options.{key}" for key in IGNORED_STREAM_OPTIONS}
    fields = set(taken_ignored)
    for kind in READ:
        fields |= set(READ[kind]) | set(DEFAULT_ONLY.get(kind, {}))
    assert fields - set(rows) == set()
    assert {name for name, row in rows.items() if "accepted and ignored" in row} == taken_ignored
    assert set(ROUTES_SAID.split(", ")) - set(rows) == set()
