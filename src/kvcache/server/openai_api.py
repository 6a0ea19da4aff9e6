"""The OpenAI wire format: request bodies read into an engine prompt and SamplingParams (every
field checked, a bad one named in a 400), and the response, chunk and error objects.

Only what kvcache serves is accepted: text content (a string, or parts of type "text"), up to
MAX_CHOICES choices (`n`). Tools, tool_choice, assistant tool_calls and tool messages are read by
`kvcache.server.tools`; `chat_template_kwargs` are further variables of the chat template (e.g.
`enable_thinking`), and an assistant message's `reasoning_content` goes to the template too.
A field kvcache does not implement is a 400 naming it, unless `kvcache.server.fields` lists it as
accepted and ignored (ignoring it cannot change the answer); a string that is not text (a lone
surrogate, "\\ud800") is a 400 wherever it is.
OpenAI's `presence_penalty`, `frequency_penalty` and `logit_bias` (token id strings -> biases)
are applied, and of vLLM's extensions `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`ignore_eos` (generate to max_tokens) and `cache_salt` (requests of other salts share no cached
blocks). `response_format` json_object and json_schema hold the answer to JSON (`response_format`).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass

from kvcache.engine import SamplingParams
from kvcache.generation.params import SPECULATE_MODES, RequestError, encodes_as_utf8
from kvcache.generation.structured import StructuredOutput
from kvcache.server.fields import refused_field
from kvcache.server.tools import ToolFieldError, ToolRequest, history_tool_calls, read_tools
from kvcache.text.tokenizer import SPECIAL_TOKEN_NAMES


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


#: the most chat messages a request may send (fewer when the prompt limit is lower: each message
#: costs a token at least)
MAX_MESSAGES = 4096
#: the most choices (`n`) one request may ask for
MAX_CHOICES = 16
#: names chat_template_kwargs may not set: the render's own arguments and the special tokens
RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt", "tools", "chat_template", "tokenize",
                           "return_tensors", "return_dict", *SPECIAL_TOKEN_NAMES)


@dataclass
class Limits:
    """What one request may ask for: prompt tokens and max_tokens (the context caps both), and
    where each limit comes from, for the errors that cite it: prompt_source and tokens_source (a
    flag, or the context), context_source (why the context is what it is; empty: the model's)."""

    max_prompt_tokens: int
    max_tokens: int
    default_max_tokens: int
    prompt_source: str = "--max-prompt-tokens"
    tokens_source: str = "the server's --max-tokens"
    context_source: str = ""
    max_messages: int = MAX_MESSAGES  # (counted before a chat template renders them)


@dataclass
class Call:
    """One request read from its body: what to submit, and how to answer."""

    kind: str  # "chat" or "completion"
    prompt: object  # chat messages, a text, or token ids: what Engine.submit takes
    params: SamplingParams
    stream: bool
    include_usage: bool
    model: str | None
    tools: ToolRequest | None = None  # (chat) the tools offered, and how the reply may call them
    kv_hints: object = None  # the body's kv_hints, as sent (read with the x-session-id header: app)
    n: int = 1  # choices: each a request of its own, the prompt's blocks shared (kvcache.server.choices)
    template_kwargs: dict | None = None  # (chat) chat_template_kwargs: the template's further variables
    reasoning: bool | None = None  # (chat) None: the reply is not split; else whether the prompt
    # opened the reasoning block (set once the prompt is rendered: kvcache.server.reasoning)

    def template_variables(self) -> dict:
        """What the chat template gets beside the messages: chat_template_kwargs and the tools."""
        tools = {} if self.tools is None else {"tools": list(self.tools.tools)}
        return {**(self.template_kwargs or {}), **tools}


def read_call(kind: str, body: object, limits: Limits) -> Call:
    """The Call of a /v1/chat/completions (kind "chat") or /v1/completions body; ApiError(400)
    naming the first bad field."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_texts(body)
    if kind == "chat":
        prompt: object = read_messages(body.get("messages"), limits.max_messages)
    else:
        prompt = _prompt(body.get("prompt"))
    refused = refused_field(kind, body)  # (nothing is silently ignored: kvcache.server.fields)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = limits.default_max_tokens
    _integer(name, max_tokens, 1, limits.max_tokens, limits.tokens_source)
    stream = _flag(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", param="stream_options")
    include_usage = bool(options.get("include_usage", False))
    tools = _tools(body) if kind == "chat" else None
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
        top_k=_top_k(body.get("top_k")),
        seed=_seed(body.get("seed")),
        stop=_stop(body.get("stop")),
        ignore_eos=_flag(body, "ignore_eos"),  # vLLM's extension: run to max_tokens
        cache_salt=body.get("cache_salt"),  # vLLM's: requests of other salts share no cached blocks
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),  # vLLM's
        structured=_structured_output(body, tools),
        logprobs=_logprobs(kind, body),
        speculate=_speculate(body.get("speculate")),
        **_logit_changes(body),
    )
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {type(model).__name__}", param="model")
    kwargs = read_template_kwargs(body.get("chat_template_kwargs")) if kind == "chat" else None
    return Call(kind, prompt, params, stream, include_usage, model, tools, body.get("kv_hints"),
                _choices(body.get("n")), kwargs)


def _choices(value: object) -> int:
    """`n`: how many choices, 1 to MAX_CHOICES (null: 1)."""
    if value is None:
        return 1
    _integer("n", value, 1, MAX_CHOICES, "this server's bound on choices per request")
    return int(value)  # type: ignore[arg-type]


def read_template_kwargs(value: object) -> dict | None:
    """chat_template_kwargs: an object of the chat template's further variables (vLLM's), passed to
    it as they are; ApiError(400) naming it, or a name the render sets itself."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApiError(400, "chat_template_kwargs must be an object of the chat template's variables (e.g. "
                       f'{{"enable_thinking": false}}), got {type(value).__name__}',
                       param="chat_template_kwargs")
    for name in value:
        if name in RESERVED_TEMPLATE_NAMES:
            what = "send tools as the request's tools field" if name == "tools" else "the server sets it"
            raise ApiError(400, f"chat_template_kwargs.{name} cannot be set: {what}",
                           param=f"chat_template_kwargs.{name}")
    return dict(value)


def _tools(body: dict) -> ToolRequest | None:
    try:
        return read_tools(body)
    except ToolFieldError as error:
        raise ApiError(400, str(error), param=error.param) from None


def _structured_output(body: dict, tools: ToolRequest | None) -> StructuredOutput | None:
    """response_format's output, or the grammar of a forced tool call (tool_choice "required" or a
    function); both at once is a 400 naming tool_choice."""
    output = response_format(body.get("response_format"))
    try:
        forced = None if tools is None else tools.grammar()
    except ToolFieldError as error:
        raise ApiError(400, str(error), param=error.param) from None
    if forced is not None and output is not None:
        raise ApiError(400, f"tool_choice {tools.choice!r} holds the reply to tool calls, and "
                       "response_format to its format: give one of them", param="tool_choice")
    return forced or output


def check_prompt_length(tokens: int, max_tokens: int, limits: Limits, context: int) -> None:
    """ApiError(400) when the prompt is longer than the server allows or the prompt plus
    max_tokens is past the model's context."""
    if tokens > limits.max_prompt_tokens:
        raise ApiError(
            400,
            f"the prompt has {tokens} tokens, more than this server's limit of "
            f"{limits.max_prompt_tokens} ({limits.prompt_source})",
            param="messages",
            code="context_length_exceeded",
        )
    if tokens + max_tokens > context:
        source = limits.context_source
        whose = f"server's maximum context length is {context} tokens ({source})" if source else (
            f"model's maximum context length is {context} tokens")
        raise ApiError(
            400,
            f"this {whose}; the prompt has {tokens} and max_tokens asks for {max_tokens} more",
            param="max_tokens",
            code="context_length_exceeded",
        )


# ---- responses ---------------------------------------------------------------------------------
def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage_object(prompt: int, cached: int, completion: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def choice_object(
    call: Call, index: int, text: str | None, finish: str, logprobs: dict | None = None,
    tool_calls: list[dict] | None = None, reasoning: str | None = None,
) -> dict:
    """One choice of a whole answer: its text (chat: what it said beside its `tool_calls`, or None),
    its reasoning (`reasoning_content`, when the reply had a reasoning block), logprobs when asked."""
    if call.kind != "chat":
        return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    message: dict = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def response_object(call: Call, rid: str, model: str, choices: list[dict], usage: dict,
                    kv_drift: dict | None = None) -> dict:
    """The whole (non-streamed) answer of its choices (`choice_object`); kv_drift (when the drift
    probe sampled the request) beside its usage."""
    return {
        "id": rid,
        "object": "chat.completion" if call.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage,
        **({} if kv_drift is None else {"kv_drift": kv_drift}),
    }


def chunk_object(
    call: Call,
    rid: str,
    model: str,
    text: str | None,
    finish: str | None,
    *,
    index: int = 0,
    first: bool = False,
    usage: dict | None = None,
    kv_drift: dict | None = None,
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
    reasoning: str | None = None,
) -> dict:
    """One streamed event of choice `index`: a piece of text (with its tokens' logprobs when asked),
    a piece of reasoning (`reasoning_content`), tool calls (`tool_call_objects(..., streamed=True)`),
    the finish reason, or (choices empty) the usage (and kv_drift beside it when the drift probe
    sampled the request)."""
    if usage is not None:
        choices: list = []
    elif call.kind == "chat":
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]
    else:
        choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}]
    chunk = {
        "id": rid,
        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    if kv_drift is not None:
        chunk["kv_drift"] = kv_drift
    return chunk


# ---- fields ------------------------------------------------------------------------------------
def check_texts(body: dict) -> None:
    """ApiError(400) naming a string of `body` (a key or a value, at any depth, in fields kvcache
    ignores too) that is not text: one holding a lone surrogate (JSON's "\\ud800"), which UTF-8
    cannot encode, so a tokenizer, a salt's hash or the answer's JSON would fail on it."""
    pending: list[tuple[str, object]] = [("", body)]
    while pending:  # (a loop, not recursion: the parser nests deeper than Python calls may)
        where, value = pending.pop()
        if isinstance(value, str) and not encodes_as_utf8(value):
            raise _not_text(where)
        if isinstance(value, dict):
            for key, item in value.items():
                if not encodes_as_utf8(key):
                    raise _not_text(where, key=True)
                pending.append((f"{where}.{key}" if where else key, item))
        elif isinstance(value, list):
            pending.extend((f"{where}[{index}]", item) for index, item in enumerate(value)
                           if isinstance(item, (str, dict, list)))


def _not_text(where: str, key: bool = False) -> ApiError:
    what = f"a key of {where or 'the request body'}" if key else where
    return ApiError(400, f"{what} holds a lone surrogate (a \\ud800-\\udfff escape without its pair): "
                    "not text", param=where or None)


def read_messages(messages: object, limit: int) -> list[dict]:
    """The {role, content} messages (tool calls and results too) of a chat body; ApiError(400)
    naming a bad one, or more than `limit`."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", param="messages")
    if len(messages) > limit:
        raise ApiError(400, f"messages holds {len(messages)} messages, more than this server takes ({limit}: "
                       "each costs a token of the prompt at least)", param="messages",
                       code="context_length_exceeded")
    return [_message(message, f"messages[{index}]") for index, message in enumerate(messages)]


def _message(message: object, where: str) -> dict:
    """{role, content} of one chat message (with an assistant's tool_calls and reasoning_content, a
    tool message's tool_call_id); ApiError(400) naming a legacy function message, or a key kvcache would drop
    (its other keys may be null or empty, as a replayed reply's are)."""
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    role = message.get("role")
    if role == "function":
        raise ApiError(400, f"{where} is a function message (role 'function', OpenAI's older form): send "
                       "tool calls and tool messages (role 'tool') instead; it is not supported by this "
                       "server (yet)", param=where)
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise ApiError(400, f"{where}.role must be system, user, assistant or tool, got {role!r}",
                       param=where)
    read = {"role": "system" if role == "developer" else role}
    allowed = {"assistant": ("tool_calls", "reasoning_content"),
               "tool": ("tool_call_id", "name")}.get(role, ())
    for key, value in message.items():
        if key in ("role", "content") or value is None or value == []:
            continue
        if key not in allowed:
            raise ApiError(400, f"{where}.{key} is not supported by this server (yet) on a {role} message: "
                           "it is read as its role and content (an assistant's tool_calls and "
                           "reasoning_content, a tool's tool_call_id)",
                           param=f"{where}.{key}")
        read[key] = _tool_key(key, value, f"{where}.{key}")
    more = read.get("tool_calls") or read.get("reasoning_content")  # (a reply of calls or reasoning only)
    content = message.get("content")
    read["content"] = "" if more and content is None else _content(content, where)
    return read


def _tool_key(key: str, value: object, where: str) -> object:
    if key == "tool_calls":
        try:
            return history_tool_calls(value, where)
        except ToolFieldError as error:
            raise ApiError(400, str(error), param=error.param) from None
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string, got {type(value).__name__}", param=where)
    return value


def _content(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(text, str):
                raise ApiError(
                    400, f"{where}.content parts must be of type text (kvcache reads text only)", param=where
                )
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts", param=where)


def _prompt(prompt: object) -> object:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise ApiError(400, "one prompt per request (kvcache returns one choice)", param="prompt")
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r}", param=name)
    return value


def _integer(name: str, value: object, low: int, high: int, limit: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    if value < low:
        raise ApiError(400, f"{name} must be at least {low}, got {value}", param=name)
    if value > high:
        raise ApiError(400, f"{name} may be at most {high} ({limit}), got {value}", param=name)


def _number(body: dict, name: str, default: float, low: float, high: float, open_low: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 1 << 64:
        raise ApiError(400, f"{name} must be a number in range, got an integer of {len(str(value))} digits",
                       param=name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
    if (value <= low if open_low else value < low) or value > high:
        bounds = f"({low:g}, {high:g}]" if open_low else f"[{low:g}, {high:g}]"
        bounds = f"({low:g}, inf)" if high == math.inf else bounds
        raise ApiError(400, f"{name} must be in {bounds}, got {value}", param=name)
    return float(value)


def response_format(value: object) -> StructuredOutput | None:
    """The StructuredOutput of OpenAI's response_format: {"type": "text"} or null (none),
    {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict",
    "description"}}; ApiError(400) naming the part that is wrong or that llguidance refuses."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise ApiError(400, 'response_format must be an object whose type is "text", "json_object" or '
                       f'"json_schema", got {str(value)[:80]}', param="response_format")
    extra = sorted(set(value) - {"type", "json_schema"}) or (["json_schema"] if kind != "json_schema" and
                                                            "json_schema" in value else [])
    if extra:
        raise ApiError(400, f"response_format.{extra[0]} is not read with type {kind!r}",
                       param=f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return _structured("json_object", "", "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError(400, 'response_format.json_schema must be an object with a "name" (a string) and a '
                       '"schema"', param="response_format.json_schema")
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApiError(400, f"response_format.json_schema.{unknown[0]} is not a field of json_schema "
                       "(name, schema, strict, description)",
                       param=f"response_format.json_schema.{unknown[0]}")
    if spec.get("strict") not in (None, True, False):
        raise ApiError(400, "response_format.json_schema.strict must be a boolean",
                       param="response_format.json_schema.strict")
    schema = spec.get("schema", {})  # OpenAI's: no schema is any JSON
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"response_format.json_schema.schema must be a JSON schema (an object), got "
                       f"{type(schema).__name__}", param="response_format.json_schema.schema")
    return _structured("json_schema", json.dumps(schema), "response_format.json_schema.schema")


def _logprobs(kind: str, body: dict) -> int | None:
    """How many top log-probs a token gets, or None: chat's logprobs (a boolean) and top_logprobs
    (0 to 20, only with logprobs true), completions' logprobs (0 to 5, OpenAI's bound)."""
    if kind == "completion":
        value = body.get("logprobs")
        if value is None:
            return None
        _integer("logprobs", value, 0, 5, "OpenAI's bound")
        return int(value)  # type: ignore[arg-type]
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted not in (None, True, False):
        raise ApiError(400, f"logprobs must be a boolean, got {wanted!r:.40}", param="logprobs")
    if top is not None:
        _integer("top_logprobs", top, 0, 20, "OpenAI's bound")
        if top and not wanted:
            raise ApiError(400, "top_logprobs needs logprobs true", param="top_logprobs")
    return (top or 0) if wanted else None


def logprobs_object(kind: str, entries: list, decode, offset: int = 0) -> dict:
    """OpenAI's logprobs of a choice from TokenLogprobs entries (`decode(id)`: a token's text):
    chat's {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}, or completions'
    {tokens, token_logprobs, top_logprobs, text_offset}, the offsets counted from `offset`."""
    if kind == "chat":
        def item(token: int, logprob: float) -> dict:
            text = decode(token)
            return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}
        content = [{**item(entry.token, entry.logprob),
                    "top_logprobs": [item(token, value) for token, value in entry.top]} for entry in entries]
        return {"content": content, "refusal": None}
    texts = [decode(entry.token) for entry in entries]
    offsets = []
    for text in texts:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": texts, "token_logprobs": [_finite(entry.logprob) for entry in entries],
            "top_logprobs": [{decode(token): _finite(value) for token, value in entry.top}
                             for entry in entries],
            "text_offset": offsets}


def _finite(logprob: float) -> float:
    """A log-prob JSON can carry: -inf (a token the model cannot choose) as vLLM writes it, -9999."""
    return max(logprob, -9999.0)


def _structured(kind: str, source: str, field: str) -> StructuredOutput:
    try:
        return StructuredOutput(kind, source, field)
    except RequestError as error:
        raise ApiError(400, str(error), param=field) from None


def _logit_changes(body: dict) -> dict:
    """The SamplingParams fields that change the logits: OpenAI's penalties and logit_bias, vLLM's
    min_p and repetition_penalty."""
    return {
        "min_p": _number(body, "min_p", 0.0, 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", 0.0, -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.0, math.inf, open_low=True),
        "logit_bias": _logit_bias(body.get("logit_bias")),
    }


def _logit_bias(value: object) -> dict[int, float]:
    """{token id: bias} of OpenAI's logit_bias (ids as strings, biases in [-100, 100]); the ids are
    checked against the vocabulary at submit."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ApiError(400, f"logit_bias must be an object of token ids (strings) to biases in [-100, 100], "
                       f"got {type(value).__name__}", param="logit_bias")
    biases = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdecimal() and len(key) <= 12):
            raise ApiError(400, f"logit_bias keys must be token ids (decimal strings), got {key!r:.40}",
                           param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias[{key!r}] must be a number in [-100, 100], got {bias!r:.40}",
                           param="logit_bias")
        biases[int(key)] = float(bias)
    return biases


def _stop_token_ids(value: object) -> tuple[int, ...]:
    """vLLM's stop_token_ids: token ids that end the reply (checked against the vocabulary at submit)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_id(token) and 0 <= token < 1 << 40 for token in value):
        raise ApiError(400, "stop_token_ids must be a list of token ids (integers >= 0)",
                       param="stop_token_ids")
    return tuple(value)


def _top_k(value: object) -> int | None:
    if value is None or value == -1 or value == 0:
        return None  # vLLM's "off"
    _integer("top_k", value, 1, 1 << 31, "a sane bound")
    return int(value)  # type: ignore[arg-type]


def _speculate(value: object) -> str | None:
    """`speculate`: "ngram" (prompt lookup drafts), "off" (none, whatever the server's default),
    or null (the server's `--speculate`)."""
    if value is not None and value not in SPECULATE_MODES:
        raise ApiError(400, f"speculate must be null or one of {list(SPECULATE_MODES)}, got {value!r:.80}",
                       param="speculate")
    return value


def _seed(value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"seed must be an integer, got {value!r}", param="seed")
    return value % (1 << 63)  # OpenAI accepts negative seeds; the generator wants >= 0


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", param="stop")
    return tuple(stops)
