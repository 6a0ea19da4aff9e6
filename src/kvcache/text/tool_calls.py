"""Tool calls as a chat template writes them: which family a template belongs to, the calls read
back out of a reply, a stream's text split into what may go out as content and what is held for
the calls, and the Lark grammar that makes a reply one (or more) well-formed calls.

Each family is one row of FAMILIES (how its template's source shows it, where a call starts in a
reply, how calls are read, the grammar of a forced reply):
- "hermes" (Qwen2.5, Hermes, and the templates that copy them): each call is
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, anywhere in the reply, several at once;
- "mistral" (Mistral's templates): `[TOOL_CALLS] ` then a JSON list of `{"name": ..., "arguments": {...}}`
  (several calls in the one list), after any content; a reply that is only the list is read too (the
  marker is a special token in Mistral's tokenizers, dropped when a reply is detokenized);
- "llama3" (Llama-3.1 and 3.2's JSON tool calls): the whole reply is one JSON object
  `{"name": ..., "parameters": {...}}`, perhaps after `<|python_tag|>`; one call a reply.
A template that renders `tools` in no known family is `None` from `tool_format`: its calls could not
be read back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MISTRAL = "[TOOL_CALLS]"
PYTHON_TAG = "<|python_tag|>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
# (spaced as json.dumps and the templates' tojson write a call back into the history)
_SPACING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolCall:
    """One call read from a reply: the function's name and its arguments (JSON text of an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Family:
    """One tool-call family: `signs`, all in a template's source, say the template writes it; a call
    starts at one of `markers` anywhere, or at one of `openings` as the reply's first text (after
    whitespace); `split(text, names)`
    -> (the text beside the calls, the calls), or None when `text` is not calls of this family;
    `grammar(schemas, parallel)` -> the Lark rules of a reply of only calls (each schema one
    function's call object)."""

    name: str
    signs: tuple[str, ...]
    markers: tuple[str, ...]
    openings: tuple[str, ...]
    split: Callable[[str, set[str]], tuple[str, list[ToolCall]] | None]
    grammar: Callable[[list[dict], bool], str]
    arguments: str  # the key a call's arguments are written under


def tool_format(template: str | None) -> str | None:
    """The tool-call family of a chat template's source (a name in FAMILIES), or None when it renders
    no tools or writes them in a format kvcache cannot read back."""
    if not template or "tools" not in template:
        return None
    for family in FAMILIES.values():
        if all(sign in template for sign in family.signs):
            return family.name
    return None


def parse_tool_calls(text: str, names: set[str], family: str = "hermes") -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a reply in `family`: the text beside the calls (None when only whitespace)
    and each call. A reply whose calls do not all parse (not JSON, no name, a name not among `names`,
    arguments not an object, a call left open) is plain content: (text, [])."""
    split = FAMILIES[family].split(text, names)
    if split is None:
        return text, []
    rest, calls = split
    return (rest.strip() or None), calls


def _call(value: object, names: set[str]) -> ToolCall | None:
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


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _hermes_split(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    if OPEN not in text:
        return None
    calls = [_call(_json(body), names) for body in _BLOCK.findall(text)]
    rest = _BLOCK.sub("", text)
    if not calls or None in calls or OPEN in rest:
        return None
    return rest, calls


def _mistral_split(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    at = text.find(MISTRAL)
    if at < 0 and not text.lstrip().startswith("["):
        return None
    value = _json(text[at + len(MISTRAL):] if at >= 0 else text)
    if not isinstance(value, list) or not value:
        return None
    calls = [_call(item, names) for item in value]
    return None if None in calls else (text[:max(at, 0)], calls)


def _llama3_split(text: str, names: set[str]) -> tuple[str, list[ToolCall]] | None:
    body = text.strip()
    body = body[len(PYTHON_TAG):] if body.startswith(PYTHON_TAG) else body
    call = _call(_json(body), names)
    return None if call is None else ("", [call])


def _hermes_grammar(schemas: list[dict], parallel: bool) -> str:
    more = ' ("\\n" call)*' if parallel else ""  # (calls one a line, as the templates write them back)
    return (f"start: call{more}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(_one_of(schemas))}\n")


def _mistral_grammar(schemas: list[dict], parallel: bool) -> str:
    calls = {"type": "array", "items": _one_of(schemas, spaced=False), "minItems": 1,
             **({} if parallel else {"maxItems": 1}), "x-guidance": _SPACING}
    return f'start: "{MISTRAL} " body\nbody: %json {json.dumps(calls)}\n'  # (as the template writes it)


def _llama3_grammar(schemas: list[dict], parallel: bool) -> str:
    return f"start: body\nbody: %json {json.dumps(_one_of(schemas))}\n"  # (one call a reply)


def _one_of(schemas: list[dict], spaced: bool = True) -> dict:
    schema = dict(schemas[0]) if len(schemas) == 1 else {"anyOf": schemas}
    return {**schema, "x-guidance": _SPACING} if spaced else schema


FAMILIES: dict[str, Family] = {family.name: family for family in (
    Family("hermes", (OPEN, CLOSE), (OPEN,), (), _hermes_split, _hermes_grammar, "arguments"),
    # (a bare list opening the reply: [TOOL_CALLS] is a special token the detokenizer drops)
    Family("mistral", (MISTRAL,), (MISTRAL,), ("[",), _mistral_split, _mistral_grammar, "arguments"),
    Family("llama3", ('"parameters": ', '"name": '), (), (PYTHON_TAG, "{"), _llama3_split,
           _llama3_grammar, "parameters"),
)}


class ToolStream:
    """A streamed reply split as it comes: `feed(piece)` gives the content that may go out now (text
    before any call of `family`, and never a piece that could be a call's start); from a call's start
    on, the text is held; `finish()` gives (the held content, the calls) once the reply is whole."""

    def __init__(self, names: set[str], family: str = "hermes") -> None:
        self.names, self.family = names, FAMILIES[family]
        self.sent = ""  # content already given out
        self.held = ""  # text not yet given out
        self.calling = False  # a call has started: the rest is held

    def feed(self, piece: str) -> str:
        self.held += piece
        if self.calling:
            return ""
        at = self._start()
        if at is not None:
            self.calling = True
            out, self.held = self.held[:at], self.held[at:]
        else:
            keep = self._partial()
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        self.sent += out
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet given out, calls): the calls when the held text parses as tool calls,
        else all of it as content."""
        split = self.family.split(self.held, self.names) if self.calling else None
        if split is None:
            return self.held, []
        rest, calls = split
        return (rest.rstrip() if self.sent.strip() else rest.strip()), calls

    def _start(self) -> int | None:
        """Where in the held text a call starts (None: none has)."""
        if not self.sent and self.family.openings and self.held.lstrip().startswith(self.family.openings):
            return 0  # (the whitespace before the call is held with it)
        found = [at for at in (self.held.find(marker) for marker in self.family.markers) if at >= 0]
        return min(found) if found else None

    def _partial(self) -> int:
        """How many characters at the end of the held text could begin a call."""
        text = self.held.lstrip()
        if not self.sent and any(opening.startswith(text) for opening in self.family.openings):
            return len(self.held)
        return partial_marker(self.held, self.family.markers)


def partial_marker(text: str, markers) -> int:
    """How many characters at the end of `text` could begin one of `markers` (what a stream holds
    back until the next piece says whether a marker comes)."""
    for size in range(min(max(map(len, markers), default=1) - 1, len(text)), 0, -1):
        if any(marker.startswith(text[-size:]) for marker in markers):
            return size
    return 0


def call_grammar(tools: list[dict], parallel: bool, family: str = "hermes") -> str:
    """A Lark grammar (llguidance's, JSON by `%json`) of a reply that is only tool calls of `family`:
    one call, or one or more when `parallel` and the family allows several; each call's name one of
    `tools`' (OpenAI's {"type": "function", "function": {name, parameters}}) and its arguments held to
    that function's parameters schema, written as the family's template writes a call back."""
    row = FAMILIES[family]
    return row.grammar([_call_schema(tool["function"], row.arguments) for tool in tools], parallel)


def _call_schema(function: dict, arguments: str) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments: parameters},
            "required": ["name", arguments], "additionalProperties": False}
