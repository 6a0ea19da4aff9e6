"""`n` choices through the server and the official `openai` client: each choice carries its index,
with a seed the children differ and the whole answer is reproducible, greedy children are the
same, the prompt is counted once and prefilled once (the later children attach the first's
blocks: `usage.kvcache_cached_tokens_by_choice`), streamed chunks carry their choice's index and
join into the whole answer's choices, completions take `n` too, and more than MAX_CHOICES is a
400 naming `n`."""

from __future__ import annotations

import uuid

import openai
import pytest
from conftest import API_KEY

from kvcache.server.openai_api import MAX_CHOICES

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
BLOCK = 8  # (the test engine's block size)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def _fresh() -> list[dict]:
    """A question no earlier test sent (its prompt is in no cached block)."""
    return [{"role": "user", "content": f"Tell me a story about {uuid.uuid4().hex}."}]


def _ask(client, messages, **options):
    return client.chat.completions.create(**{"model": "kvcache-test", "messages": messages, "max_tokens": 6,
                                             "extra_body": {"ignore_eos": True}, **options})


def test_n_seeded_choices_differ_and_the_whole_answer_is_reproducible(client):
    messages = _fresh()
    first = _ask(client, messages, n=3, temperature=1.0, seed=7)
    again = _ask(client, messages, n=3, temperature=1.0, seed=7)
    texts = [choice.message.content for choice in first.choices]
    assert [choice.index for choice in first.choices] == [0, 1, 2]
    assert [choice.message.content for choice in again.choices] == texts
    assert len(set(texts)) > 1
    alone = _ask(client, messages, temperature=1.0, seed=7)  # choice 0 is the request with n = 1
    assert alone.choices[0].message.content == texts[0]


def test_greedy_choices_are_the_same_and_the_prompt_is_counted_and_prefilled_once(client):
    reply = _ask(client, _fresh(), n=3, temperature=0)
    assert len({choice.message.content for choice in reply.choices}) == 1
    usage = reply.usage
    assert usage.completion_tokens == 3 * 6 and usage.total_tokens == usage.prompt_tokens + 18
    by_choice = usage.kvcache_cached_tokens_by_choice  # (each choice's prompt tokens found cached)
    assert usage.prompt_tokens_details.cached_tokens == by_choice[0] < usage.prompt_tokens - BLOCK
    # the later choices attach the first's blocks: at most the tokens past its last whole block are
    # computed again (the last prompt token always is: its logits choose the first new token)
    shared = (usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert all(shared <= cached < usage.prompt_tokens for cached in by_choice[1:]), by_choice


def test_streamed_choices_carry_their_index_and_join_into_the_whole_answers(client):
    messages = _fresh()
    whole = _ask(client, messages, n=3, temperature=1.0, seed=11)
    texts, finishes, usage = ["", "", ""], [None, None, None], None
    for chunk in _ask(client, messages, n=3, temperature=1.0, seed=11, stream=True,
                      stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == [choice.message.content for choice in whole.choices]
    assert finishes == ["length"] * 3 and usage.completion_tokens == 18


def test_completions_take_n(client):
    reply = client.completions.create(model="kvcache-test", prompt=f"Once upon {uuid.uuid4().hex}", n=2,
                                      max_tokens=4, temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [choice.index for choice in reply.choices] == [0, 1] and reply.usage.completion_tokens == 8


def test_more_choices_than_the_bound_are_a_400_naming_n(client):
    with pytest.raises(openai.BadRequestError) as raised:
        _ask(client, _fresh(), n=MAX_CHOICES + 1)
    assert raised.value.param == "n" and str(MAX_CHOICES) in raised.value.message
