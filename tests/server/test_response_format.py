"""Structured outputs through the server and the official `openai` client: response_format
json_schema and json_object on chat and completions (streamed too) answer JSON that validates,
finish "stop"; max_tokens reached first is finish "length"; a schema llguidance refuses is a 400
naming response_format.json_schema.schema; the client's own `parse` with a pydantic model works."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest
from conftest import API_KEY

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 130},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_chat_answer_to_a_json_schema_validates(client, temperature):
    reply = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=120,
                                           temperature=temperature, seed=5, response_format=SCHEMA_FORMAT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_streamed_answer_to_a_json_schema_joins_into_valid_json(client):
    stream = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=120,
                                            temperature=1.0, seed=9, response_format=SCHEMA_FORMAT,
                                            stream=True)
    pieces, reasons = [], []
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop"
    jsonschema.validate(json.loads("".join(pieces)), PERSON)


def test_completions_take_response_format_json_object(client):
    reply = client.completions.create(model="kvcache-test", prompt="JSON:", max_tokens=200, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.text), dict)
    else:
        assert choice.finish_reason == "length" and choice.text.startswith("{")


def test_max_tokens_reached_first_is_finish_length_with_the_json_cut(client):
    reply = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=2,
                                           response_format=SCHEMA_FORMAT)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 2


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "frog"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "shape": 1}},
     "response_format.json_schema.shape"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format"),
])
def test_a_response_format_it_cannot_follow_is_a_400_naming_the_part(client, response_format, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=2,
                                       response_format=response_format)
    assert raised.value.param == param


class Pet(pydantic.BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=8)


def test_the_clients_parse_with_a_pydantic_model(client):
    reply = client.chat.completions.parse(model="kvcache-test", messages=MESSAGES, max_tokens=60,
                                          response_format=Pet)
    assert isinstance(reply.choices[0].message.parsed, Pet)


def test_a_schema_request_still_finds_its_conversations_cached_blocks(client):
    first = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=120,
                                           temperature=0, response_format=SCHEMA_FORMAT)
    later = [*MESSAGES, {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "Another one, please."}]
    second = client.chat.completions.create(model="kvcache-test", messages=later, max_tokens=120,
                                            temperature=0, response_format=SCHEMA_FORMAT)
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    jsonschema.validate(json.loads(second.choices[0].message.content), PERSON)
