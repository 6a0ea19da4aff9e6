"""logprobs through the server and the official `openai` client: chat's logprobs / top_logprobs and
completions' logprobs in OpenAI's shapes, streamed too; each is the model's log_softmax of its raw
logits (a greedy token is its own top one, whatever the temperature); a bad value is a 400 naming it."""

from __future__ import annotations

import math

import openai
import pytest
import torch
from conftest import API_KEY
from openai_streams import streamed_logprobs

from kvcache.generation.logprobs import token_logprobs

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def test_chat_logprobs_give_each_token_and_its_top_ones_best_first(client, tokenizer):
    reply = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 6
    assert "".join(item.token for item in content) == reply.choices[0].message.content
    for item in content:
        tops = [top.logprob for top in item.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert item.token == item.top_logprobs[0].token and item.logprob == pytest.approx(tops[0])
        assert bytes(item.bytes).decode("utf-8", "replace") == item.token
        assert sum(math.exp(value) for value in tops) <= 1 + 1e-5


def test_logprobs_are_the_models_before_temperature(client):
    """A sampled token's logprob is the raw distribution's: the same token, drawn at another
    temperature (same seed, so the same draw when it is the likeliest), has the same logprob."""
    asked = dict(model="kvcache-test", messages=MESSAGES, max_tokens=1, logprobs=True, top_logprobs=2)
    cold = client.chat.completions.create(**asked, temperature=0).choices[0].logprobs.content[0]
    warm = client.chat.completions.create(**asked, temperature=1.7, seed=1).choices[0].logprobs.content[0]
    assert warm.top_logprobs[0].logprob == pytest.approx(cold.top_logprobs[0].logprob, abs=1e-5)


def test_without_logprobs_the_choice_has_none(client):
    reply = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=2)
    assert reply.choices[0].logprobs is None


def test_streamed_chat_logprobs_cover_every_token_once(client):
    stream = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=8,
                                            temperature=0, logprobs=True, top_logprobs=1, stream=True,
                                            stream_options={"include_usage": True})
    items, text, usage = streamed_logprobs(stream)
    assert len(items) == usage.completion_tokens == 8
    assert "".join(item.token for item in items) == "".join(text)


def test_completions_logprobs_in_the_legacy_shape(client):
    reply = client.completions.create(model="kvcache-test", prompt="The capital of France", max_tokens=5,
                                      temperature=0, logprobs=2)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:at])) for at in range(5)]
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 2 and max(top.values()) == pytest.approx(value)
        assert top.get(token) == pytest.approx(value)
    streamed = client.completions.create(model="kvcache-test", prompt="The capital of France", max_tokens=5,
                                         temperature=0, logprobs=2, stream=True)
    tokens = [token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for token in choice.logprobs.tokens]
    assert tokens == logprobs.tokens


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("chat", {"top_logprobs": 3}, "top_logprobs"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"logprobs": "yes"}, "logprobs"),
    ("completion", {"logprobs": 6}, "logprobs"),
])
def test_a_bad_logprobs_field_is_a_400_naming_it(client, route, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=2, **fields)
        else:
            client.completions.create(model="kvcache-test", prompt="x", max_tokens=2, **fields)
    assert raised.value.param == param


def test_top_logprobs_match_a_full_sort_of_the_log_softmax():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    found = token_logprobs(logits, [5, 6, 7, 8], [0, 1, 5, 20])
    full = torch.log_softmax(logits, -1)
    for row, entry in enumerate(found):
        assert entry.logprob == pytest.approx(full[row, entry.token].item(), abs=1e-6)
        values, ids = full[row].sort(descending=True)
        want = [0, 1, 5, 20][row]
        assert [token for token, _ in entry.top] == ids[:want].tolist()
        assert [value for _, value in entry.top] == pytest.approx(values[:want].tolist(), abs=1e-6)
