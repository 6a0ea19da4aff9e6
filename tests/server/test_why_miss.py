"""usage.kvcache_prefix through the server on the bundled model: a repeated prompt is a hit, a changed
timestamp in the system prompt is named with its segment and token, counters by cause in /metrics,
GET /v1/why/{id} decodes the tokens around the divergence, and the explainer changes no answer."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch
from conftest import API_KEY
from prometheus_client.parser import text_string_to_metric_families

import kvcache
from kvcache.text.eos import default_eos

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
SYSTEM = "You answer questions about Python. The time is 2026-12-05 10:41:07 UTC, request 48213."
QUESTION = {"role": "user", "content": "What does the with statement do in a program, in one line?"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def ask(client, system: str, max_tokens: int = 6):
    messages = [{"role": "system", "content": system}, QUESTION]
    return client.chat.completions.create(model="kvcache-test", messages=messages, max_tokens=max_tokens,
                                          temperature=0)


def prefix_of(answer) -> dict:
    return answer.usage.model_extra["kvcache_prefix"]


def test_a_repeated_prompt_is_a_hit_and_a_new_one_never_seen(client):
    first = ask(client, SYSTEM + " First of its kind.")
    again = ask(client, SYSTEM + " First of its kind.")
    assert prefix_of(first)["cause"] in ("never_seen", "volatile_system_field", "edited")
    assert prefix_of(again)["cause"] == "hit" and prefix_of(again)["first_divergent_token"] is None
    assert prefix_of(again)["matched_tokens"] <= again.usage.prompt_tokens_details.cached_tokens


def test_a_changed_timestamp_in_the_system_prompt_is_named_with_its_segment(client, server, tokenizer):
    ask(client, SYSTEM)
    later = ask(client, SYSTEM.replace("10:41:07", "10:52:07"))
    found = prefix_of(later)
    assert (found["cause"], found["segment"]) == ("volatile_system_field", "system")
    assert found["matched_tokens"] == found["first_divergent_token"] > 0
    why = httpx.get(f"{server.url}/why/{later.id}", headers={"Authorization": f"Bearer {API_KEY}"},
                    timeout=TIMEOUT).json()
    assert why["cause"] == "volatile_system_field"
    assert why["before"].endswith("10:") and why["after"].startswith("5")


def test_metrics_count_requests_by_cause(client, server):
    ask(client, SYSTEM + " Counted.")
    ask(client, SYSTEM + " Counted.")
    page = httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {API_KEY}"},
                     timeout=TIMEOUT).text
    samples = {sample.labels["cause"]: sample.value
               for family in text_string_to_metric_families(page) if family.name == "kvcache_prefix_explained"
               for sample in family.samples if sample.name.endswith("_total")}
    assert samples.get("hit", 0) >= 1 and sum(samples.values()) >= 2


def test_an_unknown_id_is_a_404_naming_it(server):
    answer = httpx.get(f"{server.url}/why/chatcmpl-nothing", headers={"Authorization": f"Bearer {API_KEY}"},
                       timeout=TIMEOUT)
    assert answer.status_code == 404 and "chatcmpl-nothing" in answer.json()["error"]["message"]


def test_the_explainer_changes_no_answer(client, model, tokenizer):
    """Every cause's request answers kvcache.generate's greedy tokens for its prompt."""
    eos = default_eos(model.config.eos_token_id, tokenizer)
    for system in (SYSTEM, SYSTEM, SYSTEM.replace("48213", "48214"), "Another system prompt entirely."):
        answer = ask(client, system, max_tokens=12)
        ids = tokenizer.apply_chat_template([{"role": "system", "content": system}, QUESTION],
                                            add_generation_prompt=True)
        solo = kvcache.generate(model, torch.tensor([list(ids)]), max_new_tokens=12, eos_token_id=eos)
        expected = tokenizer.decode(solo.new_tokens[0], skip_special_tokens=True)
        assert answer.choices[0].message.content == expected, prefix_of(answer)["cause"]


def test_kvcache_why_prints_the_tokens_around_the_divergence(client, server, tmp_path, capsys):
    from kvcache.cli import main

    ask(client, SYSTEM + " For the command.")
    later = ask(client, SYSTEM.replace("48213", "48299") + " For the command.")
    key = tmp_path / "key"
    key.write_text(API_KEY + "\n")
    assert main(["why", later.id, "--url", server.base, "--api-key-file", str(key)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{later.id}: volatile_system_field in system (diverged at token")
    assert "before: '" in out and "request 482" in out and "after:  '99" in out
    assert main(["why", "chatcmpl-gone", "--url", server.base, "--api-key-file", str(key)]) == 1
    assert "404" in capsys.readouterr().err


def test_a_streamed_answer_carries_the_explanation_in_its_usage_chunk(client):
    messages = [{"role": "system", "content": SYSTEM + " Streamed."}, QUESTION]
    for expected in ("never_seen", "hit"):
        chunks = list(client.chat.completions.create(
            model="kvcache-test", messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        usage = chunks[-1].usage
        assert usage.model_extra["kvcache_prefix"]["cause"] in (expected, "volatile_system_field", "edited")
    assert usage.model_extra["kvcache_prefix"]["cause"] == "hit"
