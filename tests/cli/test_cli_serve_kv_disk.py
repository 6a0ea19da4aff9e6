"""`kvcache serve --kv-disk DIR` keeps prefix blocks across a restart: the second server on the
folder says how many blocks it kept, reports a conversation's first turn as cached tokens, and
answers as the first server did."""

from __future__ import annotations

import httpx
import pytest
from serve_process import start_serve, stop_serve

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

FIRST = [{"role": "user", "content": "What is a class in Python? Say it in a few words."}]


def _chat(base: str) -> dict:
    body = {"model": "kvcache-default", "messages": FIRST, "max_tokens": 12, "temperature": 0}
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_restarted_server_answers_from_the_blocks_it_kept_on_disk(tmp_path):
    flags = ("--kv-disk", str(tmp_path), "--block-size", "8")
    process, base = start_serve(*flags)
    try:
        first = _chat(base)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        stop_serve(process)  # after writing what it had queued
    finally:
        if process.poll() is None:
            process.kill()
    process, base = start_serve(*flags)
    try:
        again = _chat(base)
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (first["usage"]["prompt_tokens"] - 1) // 8 * 8 > 0
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        assert "blocks kept from before" in stop_serve(process)[0]
    finally:
        if process.poll() is None:
            process.kill()
