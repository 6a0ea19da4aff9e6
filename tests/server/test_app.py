"""The server driven by the real `openai` client over loopback: answers equal kvcache.generate's
greedy output streamed or not, under 32 concurrent clients too; the second turn of a
conversation comes from the prefix cache; a client that goes away frees its blocks; every error
has OpenAI's shape; /metrics parses."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch
from conftest import API_KEY, start_server, wait_for
from prometheus_client.parser import text_string_to_metric_families

import kvcache
from kvcache.server import ServerSettings
from kvcache.text.eos import default_eos

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


@pytest.fixture(scope="module")
def solo(model, tokenizer):
    """Greedy kvcache.generate of prompt ids: (token ids, text)."""
    eos = default_eos(model.config.eos_token_id, tokenizer)

    def run(ids: list[int], max_tokens: int) -> tuple[list[int], str]:
        result = kvcache.generate(model, torch.tensor([ids]), max_new_tokens=max_tokens, eos_token_id=eos)
        tokens = result.new_tokens[0]
        return tokens, tokenizer.decode(tokens, skip_special_tokens=True)

    return run


def _chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _streamed(client, **request) -> tuple[str, list]:
    chunks = list(client.chat.completions.create(stream=True, **request))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_streamed_equals_whole_equals_generate(client, tokenizer, solo):
    messages = [{"role": "user", "content": "What is a class?"}]
    tokens, expected = solo(_chat_ids(tokenizer, messages), 24)
    whole = client.chat.completions.create(
        model="kvcache-test", messages=messages, max_tokens=24, temperature=0
    )
    assert whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens == len(tokens)
    assert whole.choices[0].finish_reason == ("length" if len(tokens) == 24 else "stop")
    text, chunks = _streamed(
        client,
        model="kvcache-test",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stream_options={"include_usage": True},
    )
    assert text == expected
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)


def test_completions_take_text_or_token_ids(client, tokenizer, solo):
    ids = tokenizer.encode("The with statement")
    _, expected = solo(ids, 12)
    by_text = client.completions.create(
        model="kvcache-test", prompt="The with statement", max_tokens=12, temperature=0
    )
    by_ids = client.completions.create(model="kvcache-test", prompt=ids, max_tokens=12, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    streamed = client.completions.create(
        model="kvcache-test", prompt=ids, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["kvcache-test"]
    health = httpx.get(f"{server.base}/health", timeout=TIMEOUT)  # no key needed
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_thirty_two_concurrent_clients_each_get_their_solo_answer(client, tokenizer, solo):
    prompts = [f"Tell me about item {index}, {'please ' * (index % 5)}now." for index in range(32)]

    def ask(prompt: str) -> str:
        text, _ = _streamed(
            client,
            model="kvcache-test",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=12,
            temperature=0,
        )
        return text

    with ThreadPoolExecutor(32) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, answer in zip(prompts, answers):
        assert answer == solo(_chat_ids(tokenizer, [{"role": "user", "content": prompt}]), 12)[1]


def test_the_second_turn_is_served_from_the_prefix_cache(client):
    history = [{"role": "system", "content": "You answer questions about Python."}]
    history.append({"role": "user", "content": "What does the with statement do in a program?"})
    first = client.chat.completions.create(
        model="kvcache-test", messages=history, max_tokens=24, temperature=0
    )
    history.append({"role": "assistant", "content": first.choices[0].message.content})
    history.append({"role": "user", "content": "And a class?"})
    second = client.chat.completions.create(
        model="kvcache-test", messages=history, max_tokens=8, temperature=0
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_stop_strings_are_cut_from_the_answer_streamed_or_not(client, tokenizer, solo):
    messages = [{"role": "user", "content": "What is a class?"}]
    _, full = solo(_chat_ids(tokenizer, messages), 24)
    stop = full.strip()[3:6]  # a piece the greedy answer is sure to contain
    request = dict(model="kvcache-test", messages=messages, max_tokens=24, temperature=0, stop=[stop])
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].message.content == full[: full.find(stop)]
    assert whole.choices[0].finish_reason == "stop"
    assert _streamed(client, **request)[0] == full[: full.find(stop)]


def test_a_client_that_goes_away_mid_stream_frees_its_blocks(server):
    engine = server.engine
    wait_for(lambda: engine.stats()["running"] == 0)
    cancelled = engine.stats()["finished"].get("cancelled", 0)
    body = {"model": "kvcache-test", "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST",
        f"{server.url}/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=TIMEOUT,
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data:")) >= 3
    assert wait_for(lambda: engine.stats()["finished"].get("cancelled", 0) == cancelled + 1)
    assert wait_for(lambda: engine.stats()["blocks_used"] == 0 and engine.stats()["running"] == 0)
    engine.pool.cache.allocator.check_invariants()


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_a_missing_or_wrong_key_is_a_401(server):
    body = {"model": "kvcache-test", "prompt": "x", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.url}/completions", json=body, headers=headers, timeout=TIMEOUT)
        assert _error(response, 401)["code"] == "invalid_api_key"
    for path in ("/v1/models", "/metrics"):
        _error(httpx.get(server.base + path, timeout=TIMEOUT), 401)


def test_bad_requests_are_400s_in_openai_shape(server, model):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        (dict(content=b"{not json"), None, None),
        (dict(json={"messages": messages, "top_p": 3}), "top_p", None),
        (
            dict(json={"messages": messages, "max_tokens": model.config.max_position_embeddings}),
            "max_tokens",
            None,
        ),
        (
            dict(json={"messages": [{"role": "user", "content": "word " * 1200}]}),
            None,
            "context_length_exceeded",
        ),
        (dict(content=b"{" + b" " * (100 << 10) + b"}"), None, None),  # over the 64 KiB limit
    ]
    for request, param, code in cases:
        error = _error(httpx.post(url, headers=auth, timeout=TIMEOUT, **request), 400)
        assert error["param"] == param or param is None
        assert error["code"] == code or code is None
    assert _error(httpx.post(url, headers=auth, json={"model": "other", "messages": messages}), 404)[
        "code"
    ] == ("model_not_found")


def test_a_full_queue_is_a_429_with_retry_after(model, tokenizer):
    running = start_server(
        model, tokenizer, ServerSettings(model_name="q", max_waiting=2), max_running=1, token_budget=64
    )
    try:
        held = [running.engine.submit([1, 2, 3], max_tokens=500, ignore_eos=True) for _ in range(4)]
        response = httpx.post(
            f"{running.url}/completions", json={"prompt": "x", "max_tokens": 2}, timeout=TIMEOUT
        )
        assert _error(response, 429)["code"] == "rate_limit_exceeded"
        assert response.headers["retry-after"] == "1"
        for handle in held:
            handle.cancel()
        assert wait_for(lambda: running.engine.queue_depth == 0)
        response = httpx.post(
            f"{running.url}/completions", json={"prompt": "x", "max_tokens": 2}, timeout=TIMEOUT
        )
        assert response.status_code == 200
    finally:
        running.stop()


def test_metrics_parse_and_count(server, client):
    client.completions.create(model="kvcache-test", prompt="Hello", max_tokens=3, temperature=0)
    httpx.get(f"{server.url}/models", timeout=TIMEOUT)  # no key: a 401, counted
    page = httpx.get(
        f"{server.base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT
    )
    assert page.status_code == 200
    families = {family.name: family for family in text_string_to_metric_families(page.text)}
    for name in (
        "kvcache_requests",
        "kvcache_waiting",
        "kvcache_running",
        "kvcache_blocks_used",
        "kvcache_blocks_free",
        "kvcache_blocks_cached",
        "kvcache_prefix_hit_rate",
        "kvcache_time_to_first_token_seconds",
        "kvcache_inter_token_latency_seconds",
        "kvcache_generated_tokens",
    ):
        assert name in families, name
    outcomes = {
        s.labels.get("outcome"): s.value
        for s in families["kvcache_requests"].samples
        if s.name.endswith("_total")
    }
    assert outcomes.get("length", 0) + outcomes.get("stop", 0) >= 1 and outcomes.get("http_401", 0) >= 1
    generated = [s.value for s in families["kvcache_generated_tokens"].samples if s.name.endswith("_total")]
    assert generated and generated[0] >= 3
    assert json.loads(json.dumps(server.engine.stats()))  # the gauges' source is plain data


def test_a_ctx_size_caps_a_request_and_each_request_gets_one_access_log_line(model, tokenizer, caplog):
    import logging

    running = start_server(model, tokenizer, ServerSettings(model_name="m", context=64))
    try:
        url = f"{running.url}/completions"
        ids = list(range(5, 25))  # 20 prompt tokens
        with caplog.at_level(logging.INFO, logger="kvcache.access"):
            too_long = httpx.post(url, json={"prompt": ids, "max_tokens": 50}, timeout=TIMEOUT)
            error = _error(too_long, 400)
            assert error["code"] == "context_length_exceeded" and "64" in error["message"]
            four = {"prompt": ids, "max_tokens": 4, "ignore_eos": True}
            whole = httpx.post(url, json=four, timeout=TIMEOUT)
            assert whole.status_code == 200
            body = {"prompt": ids, "max_tokens": 3, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url, json=body, timeout=TIMEOUT) as stream:
                assert stream.status_code == 200 and stream.read()
            wait_for(lambda: len(caplog.records) >= 3, timeout=30)
        lines = [record.getMessage() for record in caplog.records]
        assert "POST /v1/completions 400" in lines[0] and "maximum context length is 64" in lines[0]
        assert "POST /v1/completions 200;" in lines[1]
        assert "prompt 20 (cached 0) + 4 tokens, length" in lines[1]
        assert "200 stream;" in lines[2] and "+ 3 tokens, length" in lines[2]
    finally:
        running.stop()


def test_cache_salt_keeps_requests_of_other_salts_from_sharing_cached_tokens(server):
    auth = {"Authorization": f"Bearer {API_KEY}"}
    url = f"{server.url}/completions"
    prompt = list(range(7, 60))

    def cached(salt) -> int:
        body = {"prompt": prompt, "max_tokens": 2, "cache_salt": salt, "temperature": 0}
        response = httpx.post(url, headers=auth, json=body, timeout=TIMEOUT)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("salt-one-for-this-test") == 0
    assert cached("salt-two-for-this-test") == 0
    assert cached("salt-one-for-this-test") > 0
    bad = httpx.post(url, headers=auth, json={"prompt": prompt, "cache_salt": 7}, timeout=TIMEOUT)
    assert "cache_salt" in _error(bad, 400)["message"]


def test_a_bound_socket_takes_no_connection_before_the_server_serves():
    import socket

    from kvcache.server import bind

    sock = bind("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):  # nothing queues up while a model loads
            socket.create_connection(sock.getsockname()[:2], timeout=5).close()
    finally:
        sock.close()


def test_a_quantized_pool_reports_each_probed_requests_drift_and_its_capacity(model, tokenizer):
    """--kv-cache-dtype int8 with --kv-drift-sample 1: every answer carries kv_drift beside usage
    (streamed: in the usage chunk), its positions are its tokens, and /metrics counts them and
    says the sequences of the context the pool holds at each KV dtype."""
    running = start_server(model, tokenizer, ServerSettings(model_name="m", context=128), num_blocks=2048,
                           kv_dtype="int8", kv_drift_sample=1.0)
    try:
        body = {"model": "m", "prompt": "Hello there", "max_tokens": 5, "temperature": 0}
        reply = httpx.post(f"{running.url}/completions", json=body, timeout=TIMEOUT).json()
        drift = reply["kv_drift"]
        assert drift["positions"] == reply["usage"]["completion_tokens"] == 5
        assert 0 <= drift["mean_kl"] <= drift["max_kl"] and 0 <= drift["top1_agreement"] <= 1
        streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{running.url}/completions", json=streamed, timeout=TIMEOUT) as events:
            chunks = [json.loads(line[6:]) for line in events.iter_lines()
                      if line.startswith("data: {")]
        assert chunks[-1]["kv_drift"]["positions"] == chunks[-1]["usage"]["completion_tokens"]
        page = httpx.get(f"{running.base}/metrics", timeout=TIMEOUT).text
        families = {family.name: family for family in text_string_to_metric_families(page)}
        count = next(s.value for s in families["kvcache_kv_drift_kl"].samples if s.name.endswith("_count"))
        assert count == 10
        capacity = {s.labels["kv_dtype"]: s.value for s in families["kvcache_kv_capacity_sequences"].samples}
        assert capacity["float32"] < capacity["int8"] < capacity["int4"]
        assert capacity["int8"] == running.engine.capacity(128)
    finally:
        running.stop()
