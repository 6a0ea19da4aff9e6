"""The bodies of the token routes llama-server and vLLM users reach for, read and checked as the
chat route's are (a bad field named in a 400, an unknown one refused):

    POST /tokenize        llama-server's {"content", "add_special"} (special tokens not added unless
                          asked), vLLM's {"prompt", "add_special_tokens"} (added unless refused) or
                          {"messages", "add_generation_prompt"} (through the chat template)
    POST /detokenize      {"tokens": [ids]}, each id in the tokenizer's vocabulary
    POST /apply-template  {"messages"}: the prompt text the chat route would render

Both routes that take messages take `tools` and `chat_template_kwargs` too (rendered as the chat
route renders them).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcache.server.fields import refused_field
from kvcache.server.openai_api import ApiError, Limits, check_texts, read_messages, read_template_kwargs
from kvcache.server.tools import ToolFieldError, read_tools


@dataclass
class TokenizeCall:
    """What to tokenize: a text, or chat messages rendered by the chat template first."""

    text: str | None
    messages: list[dict[str, str]] | None
    add_special: bool  # the tokenizer's special tokens (BOS) added to the text
    add_generation_prompt: bool  # (messages only) the template's opening of the assistant's turn
    model: str | None
    tools: list | None = None  # (messages only) the tools offered to the chat template
    template_kwargs: dict | None = None  # (messages only) chat_template_kwargs


@dataclass
class TemplateCall:
    """Chat messages to render with the chat template."""

    messages: list[dict]
    add_generation_prompt: bool
    model: str | None
    tools: list | None = None  # the tools offered to the chat template
    template_kwargs: dict | None = None  # chat_template_kwargs: the template's further variables


def read_tokenize(body: object, limits: Limits) -> TokenizeCall:
    """The TokenizeCall of a /tokenize body; ApiError(400) naming the first bad field."""
    body = _checked("tokenize", body)
    given = [name for name in ("content", "prompt", "messages") if name in body]
    if len(given) != 1:
        raise ApiError(400, "/tokenize takes one of content (llama-server's), prompt or messages (vLLM's), "
                       f"got {' and '.join(given) or 'none'}", param=given[-1] if given else "content")
    if "add_special" in body and "add_special_tokens" in body:
        raise ApiError(400, "give one of add_special (llama-server's) and add_special_tokens (vLLM's)",
                       param="add_special_tokens")
    source = given[0]
    # llama-server adds no special tokens unless asked; vLLM adds them to a prompt, not to messages
    add_special = _flag(body, "add_special", _flag(body, "add_special_tokens", source == "prompt"))
    if source == "messages":
        messages = read_messages(body["messages"], limits.max_messages)
        return TokenizeCall(None, messages, add_special, _flag(body, "add_generation_prompt", True),
                            _model(body), _tools(body),
                            read_template_kwargs(body.get("chat_template_kwargs")))
    for name in ("add_generation_prompt", "tools", "chat_template_kwargs"):
        if name in body:
            raise ApiError(400, f"{name} applies to messages, not to {source}", param=name)
    text = body[source]
    if not isinstance(text, str):
        raise ApiError(400, f"{source} must be a string, got {type(text).__name__}", param=source)
    return TokenizeCall(text, None, add_special, False, _model(body))


def read_detokenize(body: object, vocab_size: int) -> tuple[list[int], str | None]:
    """(token ids, model) of a /detokenize body, each id checked to be in [0, vocab_size)."""
    body = _checked("detokenize", body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list):
        raise ApiError(400, f"tokens must be a list of token ids, got {type(tokens).__name__}",
                       param="tokens")
    for index, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ApiError(400, f"tokens[{index}] must be a token id in [0, {vocab_size}) (the tokenizer's "
                           f"vocabulary), got {token!r:.40}", param="tokens")
    return tokens, _model(body)


def read_apply_template(body: object, limits: Limits) -> TemplateCall:
    """The TemplateCall of an /apply-template body; ApiError(400) naming the first bad field."""
    body = _checked("apply-template", body)
    messages = read_messages(body.get("messages"), limits.max_messages)
    return TemplateCall(messages, _flag(body, "add_generation_prompt", True), _model(body), _tools(body),
                        read_template_kwargs(body.get("chat_template_kwargs")))


def _tools(body: dict) -> list | None:
    """The tools of a body that renders messages (checked as the chat route checks them)."""
    try:
        tools = read_tools({"tools": body.get("tools")})
    except ToolFieldError as error:
        raise ApiError(400, str(error), param=error.param) from None
    return None if tools is None else list(tools.tools)


def _checked(kind: str, body: object) -> dict:
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    check_texts(body)
    refused = refused_field(kind, body)
    if refused is not None:
        raise ApiError(400, refused[1], param=refused[0])
    return body


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false, got {value!r:.40}", param=name)
    return value


def _model(body: dict) -> str | None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, f"model must be a string, got {type(model).__name__}", param="model")
    return model
