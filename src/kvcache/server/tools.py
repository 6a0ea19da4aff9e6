"""OpenAI's tool fields read and checked (a bad one named in a 400): `tools`, `tool_choice`,
`parallel_tool_calls`; the history's assistant `tool_calls` and `tool` messages turned into what
chat templates read (a call's arguments as an object, as Hugging Face templates expect); and the
`tool_calls` of an answer in OpenAI's shape.

`tool_choice` "required" or a named function holds the reply to well-formed calls by a grammar
(`kvcache.text.tool_calls.call_grammar`), so it always parses; "auto" lets the model choose and
reads calls back when it writes them; "none" offers the tools to the template and reads nothing back.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvcache.generation.params import RequestError
from kvcache.generation.structured import StructuredOutput
from kvcache.text.tool_calls import ToolCall, call_grammar

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolFieldError(ValueError):
    """A tool field that is wrong: `param` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolRequest:
    """The tools a chat request offers (OpenAI's objects, checked), its tool_choice ("auto", "none",
    "required" or "function", then `name` says which), whether several calls may come at once, and
    the family the chat template writes calls in (`kvcache.text.tool_calls.FAMILIES`; set once the
    template is known)."""

    tools: tuple
    choice: str
    name: str | None
    parallel: bool
    family: str = "hermes"

    @property
    def names(self) -> set[str]:
        return {tool["function"]["name"] for tool in self.tools}

    def grammar(self) -> StructuredOutput | None:
        """The grammar a forced call ("required" or a named function) is held to; None otherwise."""
        if self.choice not in ("required", "function"):
            return None
        forced = [tool for tool in self.tools
                  if self.choice == "required" or tool["function"]["name"] == self.name]
        several = self.parallel and self.choice == "required"
        try:
            return StructuredOutput("grammar", call_grammar(forced, several, self.family), "tools")
        except RequestError as error:
            raise ToolFieldError(f"a tool's parameters are not a JSON schema kvcache can hold a call to: "
                                 f"{error}", "tools") from None


def read_tools(body: dict) -> ToolRequest | None:
    """The ToolRequest of a chat body (None: no tools offered); ToolFieldError naming a bad field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel not in (None, True, False):
        raise ToolFieldError(f"parallel_tool_calls must be true or false, got {parallel!r:.40}",
                             "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise ToolFieldError(f"tool_choice {_short(choice)} needs tools: this request offers none",
                                 "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ToolFieldError(f"tools must be a list of up to {MAX_TOOLS} function tools", "tools")
    checked = tuple(_tool(tool, f"tools[{index}]") for index, tool in enumerate(tools))
    names = [tool["function"]["name"] for tool in checked]
    if len(set(names)) != len(names):
        raise ToolFieldError("tools names one function twice: each name must be unique", "tools")
    kind, name = _choice(choice, set(names))
    return ToolRequest(checked, kind, name, parallel is not False)


def _tool(tool: object, where: str) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise ToolFieldError(f'{where} must be {{"type": "function", "function": {{"name", "parameters"}}}}',
                             where)
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise ToolFieldError(f"{where}.{extra[0]} is not a field of a tool (type, function)",
                             f"{where}.{extra[0]}")
    extra = sorted(set(function) - _FUNCTION_KEYS)
    if extra:
        raise ToolFieldError(f"{where}.function.{extra[0]} is not a field of a function (name, description, "
                             "parameters, strict)", f"{where}.function.{extra[0]}")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolFieldError(f"{where}.function.name must be 1 to 64 letters, digits, _, . or -, got "
                             f"{name!r:.70}", f"{where}.function.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolFieldError(f"{where}.function.parameters must be a JSON schema (an object), got "
                             f"{type(parameters).__name__}", f"{where}.function.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolFieldError(f"{where}.function.description must be a string",
                             f"{where}.function.description")
    if function.get("strict") not in (None, True, False):
        raise ToolFieldError(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    kept = {key: value for key, value in function.items() if value is not None}
    return {"type": "function", "function": kept}


def _choice(choice: object, names: set[str]) -> tuple[str, str | None]:
    if choice is None:
        return "auto", None
    if choice in ("none", "auto", "required"):
        return str(choice), None
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ToolFieldError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             f'"function": {{"name": ...}}}}, got {_short(choice)}', "tool_choice")
    if name not in names:
        raise ToolFieldError(f"tool_choice names the function {name!r:.70}, which is not among tools "
                             f"({', '.join(sorted(names))})", "tool_choice")
    return "function", name


def history_tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant message's tool_calls as chat templates read them (arguments as an object);
    ToolFieldError naming a bad one."""
    if not isinstance(calls, list):
        raise ToolFieldError(f"{where} must be a list of tool calls", where)
    read = []
    for index, call in enumerate(calls):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolFieldError(f'{at} must be {{"id", "type": "function", "function": {{"name", '
                                 '"arguments"}}', at)
        arguments = function.get("arguments", "{}")
        try:
            parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            raise ToolFieldError(f"{at}.function.arguments must be JSON text of an object, got "
                                 f"{arguments!r:.70}", f"{at}.function.arguments") from None
        if not isinstance(parsed, dict):
            raise ToolFieldError(f"{at}.function.arguments must be JSON text of an object",
                                 f"{at}.function.arguments")
        read.append({"id": str(call.get("id") or ""), "type": "function",
                     "function": {"name": function["name"], "arguments": parsed}})
    return read


def tool_call_objects(calls: list[ToolCall], streamed: bool = False) -> list[dict]:
    """OpenAI's tool_calls of an answer (with each call's index when streamed, as deltas carry it)."""
    objects = []
    for index, call in enumerate(calls):
        item = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
        objects.append({"index": index, **item} if streamed else item)
    return objects


def _short(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
