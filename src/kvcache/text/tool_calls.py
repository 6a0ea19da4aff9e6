"""Tool calls as a chat template writes them: which family a template belongs to, the calls read
back out of a reply, a stream's text split into what may go out as content and what is held for
the calls, and the Lark grammar that makes a reply one (or more) well-formed calls.

Known family: "hermes" (Qwen2.5, Hermes, and the templates that copy them): each call is
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A template that renders `tools`
in no known family is `None` from `tool_format`: its calls could not be read back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FAMILIES = ("hermes",)
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call read from a reply: the function's name and its arguments (JSON text of an object)."""

    name: str
    arguments: str


def tool_format(template: str | None) -> str | None:
    """The tool-call family of a chat template's source (one of FAMILIES), or None when it renders
    no tools or writes them in a format kvcache cannot read back."""
    if not template or "tools" not in template:
        return None
    if OPEN in template and CLOSE in template:
        return "hermes"
    return None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply: the text outside the `<tool_call>` blocks (None when only
    whitespace) and each block's call. A reply whose blocks do not all parse (not JSON, no name,
    a name not among `names`, arguments not an object, a block left open) is plain content: (text, [])."""
    if OPEN not in text:
        return text, []
    calls = []
    for body in _BLOCK.findall(text):
        call = _call(body, names)
        if call is None:
            return text, []
        calls.append(call)
    rest = _BLOCK.sub("", text)
    if not calls or OPEN in rest:
        return text, []
    return (rest.strip() or None), calls


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # (some models write the arguments as JSON text)
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolStream:
    """A streamed reply split as it comes: `feed(piece)` gives the content that may go out now (text
    before any `<tool_call>`, and never a piece that could be its start); from the first `<tool_call>`
    on, the text is held; `finish()` gives (the held content, the calls) once the reply is whole."""

    def __init__(self, names: set[str]) -> None:
        self.names = names
        self.sent = ""  # content already given out
        self.held = ""  # text not yet given out

    def feed(self, piece: str) -> str:
        self.held += piece
        if OPEN in self.sent + self.held:
            return ""
        keep = _partial_open(self.held)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet given out, calls): the calls when the held text parses as tool calls,
        else all of it as content."""
        _, calls = parse_tool_calls(self.sent + self.held, self.names)
        if not calls:
            return self.held, []
        rest = _BLOCK.sub("", self.held)
        return (rest.rstrip() if self.sent.strip() else rest.strip()), calls


def _partial_open(text: str) -> int:
    """How many characters at the end of `text` could begin `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def call_grammar(tools: list[dict], parallel: bool) -> str:
    """A Lark grammar (llguidance's, JSON by `%json`) of a reply that is only tool calls of the
    hermes family: one call, or one or more when `parallel`; each call's name one of `tools`'
    (OpenAI's {"type": "function", "function": {name, parameters}}) and its arguments held to that
    function's parameters schema."""
    schemas = [_call_schema(tool["function"]) for tool in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    # (spaced as json.dumps and the templates' tojson write a call back into the history)
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    more = ' ("\\n" call)*' if parallel else ""  # (calls one a line, as the templates write them back)
    return (f"start: call{more}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
