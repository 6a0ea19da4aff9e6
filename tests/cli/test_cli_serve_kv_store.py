"""Two `kvcache serve` processes on one real Redis: a conversation's first turn on one, its second
on the other, which reports the shared prefix as cached tokens and answers as a replica without
the store does."""

from __future__ import annotations

import re

import httpx
import pytest
from redis_server import RedisServer
from serve_process import start_serve
from waiting import wait_for

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

BLOCK = 8
FIRST = [{"role": "user", "content": "What is a class in Python? Say it in a few words."}]


@pytest.fixture(scope="module")
def replicas():
    redis = RedisServer().start()
    store = ("--kv-store", redis.url, "--block-size", str(BLOCK))
    started = [start_serve(*store), start_serve(*store), start_serve("--block-size", str(BLOCK))]
    yield [base for _, base in started]
    for process, _ in started:
        process.terminate()
        process.wait(30)
    redis.stop()


def chat(base: str, messages: list[dict]) -> dict:
    body = {"model": "kvcache-default", "messages": messages, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_second_turn_on_the_other_replica_reuses_the_first_replicas_blocks(replicas):
    first_replica, second_replica, cold = replicas
    turn = chat(first_replica, FIRST)
    reply = turn["choices"][0]["message"]["content"]
    written = 'kvcache_kv_tier_written_blocks_total{tier="redis"}'
    wait_for(lambda: metric(first_replica, written) > 0, timeout=60)  # writes are in the background
    second = [*FIRST, {"role": "assistant", "content": reply}, {"role": "user", "content": "And an object?"}]
    warm = chat(second_replica, second)
    shared = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert shared >= turn["usage"]["prompt_tokens"] // BLOCK * BLOCK > 0
    assert warm["choices"][0]["message"]["content"] == chat(cold, second)["choices"][0]["message"]["content"]
    assert metric(second_replica, "kvcache_kv_store_hit_blocks_total") == shared // BLOCK
    assert metric(second_replica, 'kvcache_kv_tier_up{tier="redis"}') == 1
    assert metric(second_replica, 'kvcache_kv_tier_invalid_blocks_total{tier="redis"}') == 0
    assert metric(second_replica, "kvcache_kv_store_tokens_served_total") == shared
    assert metric(second_replica, "kvcache_kv_store_prefill_seconds_saved_total") > 0
