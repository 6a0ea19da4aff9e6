"""Reading OpenAI request bodies: the fields become SamplingParams; every bad field is a 400 that
names it; the response objects have OpenAI's shape."""

from __future__ import annotations

import pytest

from kvcache.server.openai_api import (
    ApiError,
    Limits,
    check_prompt_length,
    choice_object,
    chunk_object,
    read_call,
    response_object,
    usage_object,
)

LIMITS = Limits(max_prompt_tokens=100, max_tokens=50, default_max_tokens=16)
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_a_chat_body_becomes_a_prompt_and_sampling_params():
    call = read_call(
        "chat",
        {
            **CHAT,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": -3,
            "stop": "\n",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        LIMITS,
    )
    assert call.prompt == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}]
    params = call.params
    assert (params.max_tokens, params.temperature, params.top_p, params.stop) == (7, 0.0, 0.5, ("\n",))
    assert params.seed == (-3) % (1 << 63) and call.stream and call.include_usage and call.model == "m"


@pytest.mark.parametrize("kind, body", [("chat", CHAT), ("completion", {"prompt": "x"})])
def test_the_sampling_fields_become_sampling_params(kind, body):
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.3, "min_p": 0.1,
              "logit_bias": {"7": -100, "3": 2.5}, "stop_token_ids": [5, 9]}
    params = read_call(kind, {**body, **fields}, LIMITS).params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p) == (
        0.5, -1.0, 1.3, 0.1)
    assert params.logit_bias == ((3, 2.5), (7, -100.0)) and params.stop_token_ids == (5, 9)
    plain = read_call(kind, body, LIMITS).params
    assert not plain.adjusts_logits and plain.min_p == 0 and plain.stop_token_ids == ()


def test_defaults_follow_openai():
    call = read_call("completion", {"prompt": ["once"]}, LIMITS)
    assert call.prompt == "once" and call.params.max_tokens == 16 and call.params.temperature == 1.0
    assert read_call("completion", {"prompt": [1, 2, 3]}, LIMITS).prompt == [1, 2, 3]


@pytest.mark.parametrize(
    ("kind", "body", "param"),
    [
        ("chat", {"messages": []}, "messages"),
        ("chat", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
        ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0]"),
        ("completion", {"prompt": ""}, "prompt"),
        ("completion", {"prompt": ["a", "b"]}, "prompt"),
        ("completion", {"prompt": [1, True]}, "prompt"),
        ("chat", {**CHAT, "max_tokens": 0}, "max_tokens"),
        ("chat", {**CHAT, "max_tokens": 51}, "max_tokens"),
        ("chat", {**CHAT, "max_completion_tokens": "9"}, "max_completion_tokens"),
        ("chat", {**CHAT, "temperature": -0.1}, "temperature"),
        ("chat", {**CHAT, "temperature": float("nan")}, "temperature"),
        ("chat", {**CHAT, "top_p": 0}, "top_p"),
        ("chat", {**CHAT, "top_p": 1.5}, "top_p"),
        ("chat", {**CHAT, "n": 17}, "n"),
        ("chat", {**CHAT, "n": True}, "n"),
        ("completion", {"prompt": "x", "n": 0}, "n"),
        ("chat", {**CHAT, "chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ("chat", {**CHAT, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
        ("chat", {**CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ("chat", {**CHAT, "chat_template_kwargs": {"bos_token": "x"}}, "chat_template_kwargs.bos_token"),
        ("chat", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ("chat", {**CHAT, "stream": "yes"}, "stream"),
        ("chat", {**CHAT, "tools": [{"type": "function"}]}, "tools[0]"),
        ("chat", {**CHAT, "seed": 1.5}, "seed"),
        ("chat", {**CHAT, "presence_penalty": 2.5}, "presence_penalty"),
        ("completion", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {**CHAT, "repetition_penalty": 0}, "repetition_penalty"),
        ("completion", {"prompt": "x", "min_p": 1.5}, "min_p"),
        ("chat", {**CHAT, "logit_bias": {"12": 101}}, "logit_bias"),
        ("chat", {**CHAT, "logit_bias": {"twelve": 1}}, "logit_bias"),
        ("completion", {"prompt": "x", "logit_bias": [12]}, "logit_bias"),
        ("chat", {**CHAT, "stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_a_bad_field_is_a_400_naming_it(kind, body, param):
    with pytest.raises(ApiError) as raised:
        read_call(kind, body, LIMITS)
    assert raised.value.status == 400 and raised.value.param == param
    error = raised.value.body()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"


def test_prompt_length_limits_say_which_limit():
    check_prompt_length(100, 10, LIMITS, context=200)
    with pytest.raises(ApiError, match="--max-prompt-tokens"):
        check_prompt_length(101, 10, LIMITS, context=200)
    with pytest.raises(ApiError, match="maximum context length is 105") as raised:
        check_prompt_length(100, 10, LIMITS, context=105)
    assert raised.value.code == "context_length_exceeded"


def test_response_and_chunk_shapes():
    chat = read_call("chat", CHAT, LIMITS)
    usage = usage_object(10, 8, 3)
    whole = response_object(chat, "chatcmpl-1", "m", [choice_object(chat, 0, "hey", "stop")], usage)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "hey"
    assert "reasoning_content" not in whole["choices"][0]["message"]
    thought = choice_object(chat, 1, "hey", "stop", reasoning="hmm")
    assert thought["index"] == 1 and thought["message"]["reasoning_content"] == "hmm"
    assert (
        whole["usage"]["total_tokens"] == 13 and whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    )
    first = chunk_object(chat, "chatcmpl-1", "m", None, None, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunk_object(chat, "chatcmpl-1", "m", None, None, usage=usage)["choices"] == []
    piece = chunk_object(chat, "chatcmpl-1", "m", None, None, index=2, reasoning="hmm")["choices"][0]
    assert piece["index"] == 2 and piece["delta"] == {"reasoning_content": "hmm"}
    completion = read_call("completion", {"prompt": "x"}, LIMITS)
    whole = response_object(completion, "cmpl-1", "m", [choice_object(completion, 0, "y", "length")], usage)
    assert whole["choices"][0]["text"] == "y"
