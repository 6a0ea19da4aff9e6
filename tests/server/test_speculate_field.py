"""Speculative decoding through the server: the request's `speculate` field read (or refused by
name), `kvcache serve --speculate` giving the engine's default, and the drafted and accepted
tokens counted in /metrics."""

from __future__ import annotations

import random
from types import SimpleNamespace

import httpx
import pytest
from conftest import API_KEY, start_server
from gguf_files import write_gguf

from kvcache import load_model
from kvcache.cli import build_parser, main
from kvcache.engine import Completion
from kvcache.engine.request import Usage
from kvcache.server import ServerSettings
from kvcache.server.metrics import ServerMetrics
from kvcache.server.openai_api import ApiError, Limits, read_call

LIMITS = Limits(max_prompt_tokens=100, max_tokens=50, default_max_tokens=16)
BODY = {"model": "m", "prompt": "x"}


@pytest.mark.parametrize("value", ["ngram", "off", None])
def test_a_requests_speculate_field_is_read_into_its_params(value):
    assert read_call("completion", {**BODY, "speculate": value}, LIMITS).params.speculate == value
    assert read_call("completion", BODY, LIMITS).params.speculate is None  # (the server's default)


@pytest.mark.parametrize("value", ["eagle", True, 3, ["ngram"]])
def test_a_speculate_field_of_no_known_mode_is_a_400_naming_it(value):
    with pytest.raises(ApiError) as raised:
        read_call("completion", {**BODY, "speculate": value}, LIMITS)
    assert raised.value.status == 400 and raised.value.param == "speculate"
    assert "speculate must be null or one of ['ngram', 'off']" in raised.value.message


def test_serve_speculate_reaches_the_engine_which_refuses_a_backend_that_would_change_tokens(capsys):
    """The bundled model runs on the float32 backend: the engine built with --speculate ngram is
    refused, naming it, before the server listens (without the flag: off)."""
    assert main(["serve", "--speculate", "ngram", "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "speculate='ngram': the engine's backend 'float32'" in error and "chunk_invariant" in error
    parser = build_parser()
    assert parser.parse_args(["serve"]).speculate is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--speculate", "eagle"])


def test_drafted_and_accepted_tokens_are_counted_in_the_metrics():
    metrics = ServerMetrics(SimpleNamespace(store_tier=None))
    for drafted, accepted in ((5, 3), (0, 0), (4, 4)):
        usage = Usage(2, 0, 3, drafted_tokens=drafted, accepted_tokens=accepted)
        metrics.finished(Completion(0, [1, 2], [3, 4, 5], "length", usage))
    assert metrics.registry.get_sample_value("kvcache_spec_drafted_tokens_total") == 9
    assert metrics.registry.get_sample_value("kvcache_spec_accepted_tokens_total") == 7


@pytest.mark.kernels
@pytest.mark.processes
def test_a_served_request_drafts_by_the_servers_default_or_opts_out(checkpoints, tokenizer, tmp_path,
                                                                     one_thread):
    """A server with --speculate's default on a tiny GGUF read with q8 activations: the same tokens
    with and without drafts, the drafts in the request's usage and in /metrics."""
    model = load_model(write_gguf(checkpoints["qwen2"][0], tmp_path / "q8.gguf", tensor_type="Q8_0"),
                       activations="q8")
    pick = random.Random(1)
    span = [pick.randrange(3, 200) for _ in range(6)]
    prompt = span + [7, 9] + span + [7] + span  # (its last n-gram occurred before: a draft is found)
    settings = ServerSettings(model_name="m", api_key=API_KEY)
    running = start_server(model, tokenizer, settings, speculate="ngram")
    try:
        with httpx.Client(headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as client:
            replies = [client.post(f"{running.url}/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                **extra}).json() for extra in ({}, {"speculate": "off"})]
            scraped = client.get(f"{running.base}/metrics").text
    finally:
        running.stop()
    drafting, plain = replies
    assert drafting["choices"][0]["text"] == plain["choices"][0]["text"]
    assert drafting["usage"]["kvcache_speculation"]["drafted_tokens"] > 0
    assert "kvcache_speculation" not in plain["usage"]
    drafted = drafting["usage"]["kvcache_speculation"]["drafted_tokens"]
    assert f"kvcache_spec_drafted_tokens_total {float(drafted)}" in scraped
