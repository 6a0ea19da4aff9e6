"""Which request fields the server reads, which it accepts only at their default, which few it
accepts and ignores (and why), and that every other field is refused by name: one table, so
nothing a client sends is silently ignored. docs/serve.md shows the same table (a test holds
them together).

A field is ignored only when ignoring it cannot change the answer: it tags, bills, stores or
routes the request.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

#: fields read into the request (their values are checked where they are read), by route
_SAMPLING = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop", "stream",
    "stream_options", "presence_penalty", "frequency_penalty", "logit_bias",
    # vLLM's extensions
    "top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos", "cache_salt",
    # an agent session's advisory KV hints (kvcache.engine.sessions; read with the x-session-id header)
    "kv_hints",
    # structured outputs (json_object, json_schema; vLLM reads it on completions too)
    "response_format",
    # choices per request (kvcache.server.choices: the prompt's blocks shared)
    "n",
    # speculative decoding, or not ("ngram", "off"; null: the server's --speculate)
    "speculate",
})
READ: dict[str, frozenset[str]] = {
    "chat": _SAMPLING | {"messages", "logprobs", "top_logprobs", "tools", "tool_choice",
                         "parallel_tool_calls", "chat_template_kwargs"},
    "completion": _SAMPLING | {"prompt", "logprobs"},
    # llama-server's content and add_special, vLLM's prompt or messages and add_special_tokens
    "tokenize": frozenset({"model", "content", "prompt", "messages", "add_special", "add_special_tokens",
                           "add_generation_prompt", "tools", "chat_template_kwargs"}),
    "detokenize": frozenset({"model", "tokens"}),
    # POST /slots/{id}?action=save: the conversation, as the chat or completion route takes it
    "slot-save": frozenset({"model", "messages", "prompt", "tools", "chat_template_kwargs", "cache_salt"}),
    "apply-template": frozenset({"model", "messages", "add_generation_prompt", "tools",
                                 "chat_template_kwargs"}),
}

#: the fields accepted and ignored, on every route that takes a body of sampling fields, and why
#: ignoring each cannot change the answer
IGNORED: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring: it tags the request only",
    "safety_identifier": "OpenAI's successor of user: a tag for abuse monitoring",
    "prompt_cache_key": "a routing hint for OpenAI's prompt cache; kvcache finds shared prefixes by "
                        "their tokens (cache_salt is what parts them)",
    "metadata": "tags for completions OpenAI stores; kvcache stores none",
    "store": "asks OpenAI to keep the completion for its dashboard; kvcache keeps none",
    "service_tier": "OpenAI's billing and latency tier; one tier here",
    "cache_prompt": "llama-server's switch for reusing a cached prefix; kvcache always reuses one, and "
                    "a reused prefix gives the tokens a recomputed one gives",
}

#: keys of stream_options accepted and ignored, and why
IGNORED_STREAM_OPTIONS: dict[str, str] = {
    "include_obfuscation": "OpenAI's random padding of stream events against size side channels; the "
                           "events' content is the same",
}
READ_STREAM_OPTIONS = frozenset({"include_usage"})


@dataclass(frozen=True)
class DefaultOnly:
    """A field read only at the value that asks for what kvcache does anyway: accepts(value) says
    whether `value` is such a value, `accepted` names them, `lacks` says what any other asks for."""

    accepts: Callable[[object], bool]
    accepted: str
    lacks: str


def _is(*values: object) -> Callable[[object], bool]:
    """A test of equality to one of `values`, exact in type (True is not 1)."""
    return lambda value: any(type(value) is type(it) and value == it for it in values)


_FUNCTIONS = DefaultOnly(_is(None, []), "an empty list or null", "OpenAI's older functions are not "
                         "implemented: send tools")
_FUNCTION_CALL = DefaultOnly(_is(None, "none", "auto"), '"none", "auto" or null', "OpenAI's older "
                             "function_call is not implemented: send tool_choice")

#: fields accepted only at their default, by route
DEFAULT_ONLY: dict[str, dict[str, DefaultOnly]] = {
    "chat": {
        "functions": _FUNCTIONS,
        "function_call": _FUNCTION_CALL,
        "modalities": DefaultOnly(_is(None, ["text"]), '["text"] or null', "only text is generated"),
    },
    "completion": {
        "best_of": DefaultOnly(_is(None, 1), "1 or null", "more than one candidate per request is not "
                               "implemented"),
        "echo": DefaultOnly(_is(None, False), "false or null", "echoing the prompt is not implemented"),
        "suffix": DefaultOnly(_is(None), "null", "inserting text before a suffix is not implemented"),
    },
    "tokenize": {  # llama-server's
        "with_pieces": DefaultOnly(_is(None, False), "false or null", "each token's piece of text is not "
                                   "implemented (POST /detokenize gives a token's text)"),
        "parse_special": DefaultOnly(_is(None, True), "true or null", "reading special tokens' text as "
                                     "plain text is not implemented"),
    },
}


def refused_field(kind: str, body: dict) -> tuple[str, str] | None:
    """(field, message) of the first field of `body` (a body of the route `kind`, a key of READ) that kvcache
    neither reads nor accepts and ignores, or reads only at its default and is given another value;
    None when every field is one it takes."""
    for name, value in body.items():
        if name in READ[kind] or name in IGNORED:
            continue
        default_only = DEFAULT_ONLY.get(kind, {}).get(name)
        if default_only is None:
            return name, unsupported(name)
        if not default_only.accepts(value):
            return name, (f"{name}={_short(value)} is not supported by this server (yet): "
                          f"{default_only.lacks}; it takes {default_only.accepted}")
    options = body.get("stream_options")
    for key in options if isinstance(options, dict) else ():
        if key not in READ_STREAM_OPTIONS and key not in IGNORED_STREAM_OPTIONS:
            return f"stream_options.{key}", unsupported(f"stream_options.{key}")
    return None


def unsupported(name: str) -> str:
    """The message of a field kvcache does not implement."""
    return (f"{name} is not supported by this server (yet): kvcache refuses a field it does not "
            "implement rather than ignore it (docs/serve.md lists the fields it reads and the few it "
            "accepts and ignores)")


def _short(value: object) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else _json(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _json(value: object) -> str:
    try:
        return json.dumps(value, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError):
        return repr(value)
