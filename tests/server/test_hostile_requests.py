"""Hostile requests against a live server on loopback: one request's preparation (its chat
template, its tokens) never holds up /health or other clients, and numbers or JSON that used to
crash a handler are 400s in OpenAI's shape naming the field."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import API_KEY, start_server

from kvcache.server import ServerSettings

TIMEOUT = 60.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class GatedTokenizer:
    """The real tokenizer, except that rendering a chat template waits on `release` (as a slow
    template would), after setting `entered`."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()

    def apply_chat_template(self, *args, **kwargs):
        self.entered.set()
        self.release.wait(TIMEOUT)
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_a_request_whose_template_is_slow_holds_up_neither_health_nor_other_clients(model, tokenizer):
    gated = GatedTokenizer(tokenizer)
    running = start_server(model, gated, ServerSettings(model_name="m"), max_running=4, token_budget=64)
    try:
        with ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, f"{running.url}/chat/completions", timeout=TIMEOUT,
                               json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            assert gated.entered.wait(TIMEOUT)  # the template is rendering now, and does not return
            assert httpx.get(f"{running.base}/health", timeout=TIMEOUT).status_code == 200
            other = httpx.post(f"{running.url}/completions", json={"prompt": [5, 6, 7], "max_tokens": 2},
                               timeout=TIMEOUT)
            assert other.status_code == 200 and not slow.done()
            gated.release.set()
            assert slow.result(TIMEOUT).status_code == 200
    finally:
        gated.release.set()
        running.stop()


HI = b'{"messages": [{"role": "user", "content": "hi"}], '


@pytest.mark.parametrize(
    "body, param",
    [
        (HI + b'"temperature": 1' + b"0" * 400 + b"}", "temperature"),
        (HI + b'"top_p": 1' + b"0" * 400 + b"}", "top_p"),
        (HI + b'"temperature": 1e400}', "temperature"),
        (b"[" * 100_000 + b"]" * 100_000, None),
    ],
)
def test_numbers_past_a_float_and_json_nested_past_the_parser_are_400s(server, body, param):
    response = httpx.post(f"{server.url}/chat/completions", content=body, headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_a_temperature_near_zero_samples_greedily_instead_of_failing(server):
    request = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 1e-300}
    tiny = httpx.post(f"{server.url}/completions", json=request, headers=AUTH, timeout=TIMEOUT)
    greedy = httpx.post(f"{server.url}/completions", json={**request, "temperature": 0}, headers=AUTH,
                        timeout=TIMEOUT)
    assert tiny.status_code == greedy.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


LONE = '"\\ud800"'  # a lone surrogate, as JSON writes it: no UTF-8 text holds it


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("completions", '{"prompt": "hi", "cache_salt": ' + LONE + "}", "cache_salt"),
        ("completions", '{"prompt": ' + LONE + "}", "prompt"),
        ("completions", '{"prompt": ["x' + LONE[1:] + "]}", "prompt[0]"),
        ("completions", '{"prompt": "hi", "stop": [' + LONE + "]}", "stop[0]"),
        ("completions", '{"prompt": "hi", "model": ' + LONE + "}", "model"),
        ("completions", '{"prompt": "hi", "user": ' + LONE + "}", "user"),
        ("chat/completions", '{"messages": [{"role": "user", "content": ' + LONE + "}]}",
         "messages[0].content"),
        ("chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": '
         + LONE + "}]}]}", "messages[0].content[0].text"),
        ("chat/completions", '{"messages": [{"role": ' + LONE + ', "content": "hi"}]}', "messages[0].role"),
        ("chat/completions", '{"messages": [{"role": "user", "content": "hi", ' + LONE + ': 1}]}',
         "messages[0]"),
    ],
)
def test_a_lone_surrogate_in_any_string_is_a_json_400_naming_the_field(server, route, body, param):
    response = httpx.post(f"{server.url}/{route}", content=body.encode(), headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert param in error["message"] and "surrogate" in error["message"]
