"""`--prerender-next-turn` on the bundled model: when a chat reply ends, the next turn's prefix (the
history and the reply as the client was sent it) runs as a one-token request in the background.
A conversation sent back whole submits the same prompts and gets the same answers with the repair
on as off (the model's own replies, greedy), and its next turn finds more of its prompt cached."""

from __future__ import annotations

import openai
import pytest
from conftest import API_KEY, start_server
from waiting import wait_for

from kvcache.server import ServerSettings

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
QUESTION = "Name three uses of a dictionary in Python."


@pytest.fixture(scope="module")
def servers(model, tokenizer):
    """{'off': a server without the repair, 'on': one with it}, each keeping the prompts and the
    one-token requests' handles its engine was given (`running.prompts`, `running.prerenders`)."""
    found = {}
    for name, prerender in (("off", False), ("on", True)):
        settings = ServerSettings(model_name="kvcache-test", api_key=API_KEY, prerender_next_turn=prerender)
        running = start_server(model, tokenizer, settings, max_running=4, token_budget=128)
        running.prompts, running.prerenders, submit = [], [], running.engine.submit

        def recorded(prompt, params, running=running, submit=submit, **options):
            handle = submit(prompt, params, **options)
            kept = running.prerenders if params.max_tokens == 1 else running.prompts
            kept.append(handle if params.max_tokens == 1 else list(prompt))
            return handle

        running.engine.submit = recorded
        found[name] = running
    yield found
    for running in found.values():
        running.stop()


def converse(running, prerenders: bool, turns: int = 3) -> list:
    """`turns` turns of a chat, each reply sent back whole; before each next turn, the background
    request of each turn so far (`prerenders`: one a turn, else none) has finished."""
    client = openai.OpenAI(base_url=running.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    history, answers = [], []
    for step in range(turns):
        history.append({"role": "user", "content": f"{QUESTION} Part {step}."})
        answers.append(client.chat.completions.create(model="kvcache-test", messages=history, max_tokens=12,
                                                      temperature=0))
        history.append({"role": "assistant", "content": answers[-1].choices[0].message.content})
        made = step + 1 if prerenders else 0
        assert wait_for(lambda made=made: len(running.prerenders) == made
                        and all(h.done for h in running.prerenders), timeout=30)
    return answers


def test_the_next_turns_prefix_is_cached_and_no_answer_changes(servers):
    off, on = converse(servers["off"], False), converse(servers["on"], True)
    assert servers["on"].prompts == servers["off"].prompts
    assert [a.choices[0].message.content for a in on] == [a.choices[0].message.content for a in off]
    cached = {name: [a.usage.prompt_tokens_details.cached_tokens for a in answers]
              for name, answers in (("off", off), ("on", on))}
    assert all(mine >= theirs for mine, theirs in zip(cached["on"], cached["off"]))
    assert sum(cached["on"]) > sum(cached["off"])
