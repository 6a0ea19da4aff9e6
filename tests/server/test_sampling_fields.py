"""The sampling fields through the server and the official `openai` client: logit_bias moves a
greedy reply off its first token, presence and frequency penalties repeat less, min_p and
repetition_penalty and stop_token_ids (vLLM's) take effect, and a bad value is a 400 naming it."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import API_KEY

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
PROMPT = "The with statement"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def completion_ids(client, tokenizer, max_tokens: int, **fields) -> list[int]:
    reply = client.completions.create(model="kvcache-test", prompt=PROMPT, max_tokens=max_tokens,
                                      temperature=0, **fields)
    return tokenizer.encode(reply.choices[0].text, add_special_tokens=False)


def test_a_logit_bias_of_minus_100_on_the_greedy_first_token_changes_the_reply(client, tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    plain = client.chat.completions.create(model="kvcache-test", messages=messages, max_tokens=6,
                                           temperature=0).choices[0].message.content
    first = tokenizer.encode(plain, add_special_tokens=False)[0]
    biased = client.chat.completions.create(model="kvcache-test", messages=messages, max_tokens=6,
                                            temperature=0, logit_bias={str(first): -100})
    text = biased.choices[0].message.content
    assert tokenizer.encode(text, add_special_tokens=False)[0] != first
    pushed = client.completions.create(model="kvcache-test", prompt=PROMPT, max_tokens=3, temperature=0,
                                       logit_bias={str(first): 100})
    assert pushed.choices[0].text.startswith(tokenizer.decode([first]))


def test_presence_and_frequency_penalties_repeat_less(client, tokenizer):
    plain = completion_ids(client, tokenizer, 48, extra_body={"ignore_eos": True})
    penalized = completion_ids(client, tokenizer, 48, presence_penalty=2.0, frequency_penalty=1.0,
                               extra_body={"ignore_eos": True})
    assert len(plain) - len(set(plain)) > len(penalized) - len(set(penalized))  # fewer repeats


def test_vllms_min_p_repetition_penalty_and_stop_token_ids_take_effect(client, tokenizer):
    plain = completion_ids(client, tokenizer, 24, extra_body={"ignore_eos": True})
    sampled_as_greedy = client.completions.create(
        model="kvcache-test", prompt=PROMPT, max_tokens=24, temperature=1.5, seed=3,
        extra_body={"min_p": 1.0, "ignore_eos": True})  # only the likeliest token is left
    assert tokenizer.encode(sampled_as_greedy.choices[0].text, add_special_tokens=False) == plain
    repeated = completion_ids(client, tokenizer, 24,
                              extra_body={"repetition_penalty": 1.8, "ignore_eos": True})
    assert repeated != plain
    stop = plain[5]
    stopped = client.completions.create(model="kvcache-test", prompt=PROMPT, max_tokens=24, temperature=0,
                                        extra_body={"stop_token_ids": [stop]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == plain.index(stop) + 1


@pytest.mark.parametrize(
    "field, value, named",
    [
        ("logit_bias", {"99999999": 1}, "logit_bias token ids must lie in"),  # past the vocabulary
        ("logit_bias", {"1": -101}, "logit_bias['1'] must be a number in [-100, 100]"),
        ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
        ("frequency_penalty", "1", "frequency_penalty must be a number"),
        ("repetition_penalty", -1, "repetition_penalty must be in (0, inf)"),
        ("min_p", 1.5, "min_p must be in [0, 1]"),
        ("stop_token_ids", [99999999], "stop_token_ids must lie in"),
    ],
)
def test_a_bad_sampling_field_is_a_400_naming_it(server, field, value, named):
    body = {"model": "kvcache-test", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            field: value}
    response = httpx.post(f"{server.url}/chat/completions", json=body, timeout=TIMEOUT,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert named in error["message"] and error["param"] in (field, None)
