"""Servers on the bundled model with a chat template of a test's own, whose replies a test may
force (a Lark grammar of the exact text on each submitted request: the tiny model writes neither
reasoning nor tool calls of its own), and the two tools the tool tests offer."""

from __future__ import annotations

import dataclasses
import json

from conftest import API_KEY, start_server

from kvcache.generation.structured import StructuredOutput
from kvcache.server import ServerSettings
from kvcache.text.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a city.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def templated_server(model, tokenizer, template: str):
    """A running server (`conftest.start_server`, 4 rows, 128 tokens a step) on `model` with
    `tokenizer` rendering chats by `template` (a Jinja source)."""
    with_template = Tokenizer(tokenizer.backend, tokenizer.special_tokens, template, tokenizer.add_bos_token)
    return start_server(model, with_template, ServerSettings(model_name="kvcache-test", api_key=API_KEY),
                        max_running=4, token_budget=128)


def force_replies(running, reply: str | None = None):
    """Makes `running`'s engine answer `running.reply` word for word while it is not None (set it
    per test), whatever the model would say; returns `running`."""
    submit = running.engine.submit
    running.reply = reply

    def forced(prompt, params, **options):
        if running.reply is None:
            return submit(prompt, params, **options)
        grammar = StructuredOutput("grammar", f"start: {json.dumps(running.reply)}\n", "test")
        return submit(prompt, dataclasses.replace(params, structured=grammar), **options)

    running.engine.submit = forced
    return running


def recording_prompts(running):
    """`running` whose engine keeps every prompt it is given (`running.prompts`, token ids)."""
    running.prompts, submit = [], running.engine.submit

    def recorded(prompt, params, **options):
        running.prompts.append(list(prompt))
        return submit(prompt, params, **options)

    running.engine.submit = recorded
    return running
