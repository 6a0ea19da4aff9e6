"""Hostile requests against a live server on loopback: one request's preparation (its chat
template, its tokens) never holds up /health or other clients, and numbers or JSON that used to
crash a handler are 400s in OpenAI's shape naming the field."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from conftest import API_KEY, start_server, wait_for

from kvcache.server import ServerSettings

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class GatedTokenizer:
    """The real tokenizer, except that rendering a chat template waits on `release` (as a slow
    template would), after setting `entered`."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.entered, self.release = threading.Event(), threading.Event()
        self.renders, self._lock = 0, threading.Lock()  # templates entered so far

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            self.renders += 1
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


def _error(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] in ("invalid_request_error", "rate_limit_error")
    return error


def test_requests_being_prepared_count_toward_max_waiting_and_the_next_gets_a_429(model, tokenizer):
    gated = GatedTokenizer(tokenizer)
    running = start_server(model, gated, ServerSettings(model_name="m", max_waiting=2), max_running=4,
                           token_budget=64)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    ids = {"prompt": [5, 6], "max_tokens": 2}
    try:
        with ThreadPoolExecutor(3) as pool:
            held = [pool.submit(httpx.post, f"{running.url}/chat/completions", json=chat, timeout=TIMEOUT)
                    for _ in range(2)]
            assert wait_for(lambda: gated.renders == 2)  # both rendering their template, neither returns
            assert running.engine.queue_depth == 0  # (none has reached the engine's queue)
            third = pool.submit(httpx.post, f"{running.url}/completions", json=ids, timeout=TIMEOUT)
            assert wait_for(third.done)  # refused at once, not queued behind the templates
            assert _error(third.result(), 429)["code"] == "rate_limit_exceeded"
            assert third.result().headers["retry-after"] == "1"
            gated.release.set()
            assert [response.result(TIMEOUT).status_code for response in held] == [200, 200]
        after = httpx.post(f"{running.url}/completions", json=ids, timeout=TIMEOUT)
        assert after.status_code == 200  # the places came back
    finally:
        gated.release.set()
        running.stop()


def test_more_messages_than_the_context_holds_are_a_400_before_any_template_renders(model, tokenizer):
    gated = GatedTokenizer(tokenizer)
    gated.release.set()
    running = start_server(model, gated, ServerSettings(model_name="m", context=64))
    try:
        url = f"{running.url}/chat/completions"
        messages = [{"role": "user", "content": ""}] * 64  # each costs a token at least: 63 may fit
        error = _error(httpx.post(url, json={"messages": messages, "max_tokens": 1}, timeout=TIMEOUT), 400)
        assert error["param"] == "messages" and "64 messages" in error["message"] and "63" in error["message"]
        assert gated.renders == 0
        fewer = {"messages": messages[:63], "max_tokens": 1}
        error = _error(httpx.post(url, json=fewer, timeout=TIMEOUT), 400)
        assert error["code"] == "context_length_exceeded" and gated.renders == 1  # rendered, then too long
    finally:
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
