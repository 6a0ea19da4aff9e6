"""Chat templates: a stranger's jinja2 program, run in jinja2's immutable sandbox under limits.

The sandbox stops a template from reaching Python (attributes, imports, mutating its inputs)
but not from running forever or filling memory: `{% for %}` loops nested over the sandbox's
100,000-item ranges, or a string doubled forty times. So rendering here is bounded:

- time: `MAX_RENDER_SECONDS`, checked on every line the compiled template runs (a trace function
  on the rendering thread, removed after);
- size: no string or list the template builds, and not its output, may pass `MAX_OUTPUT_CHARS`:
  `+`, `*`, `**` and `%` are checked before they run (a repetition that would pass the limit is
  never computed), and so is every filter and method call that sizes its output from an argument
  (`center(2**34)`, `tojson(indent=…)`, `'%2000000000d'|format(1)`, `replace`, `join`, `indent`:
  `_check_call`); the template's variables are checked on every line (`~` doubling);
- source: a template of more than `MAX_TEMPLATE_BYTES` is refused before it is compiled.

Each limit raises `TemplateLimitError` (a ValueError) naming it.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from datetime import datetime

MAX_TEMPLATE_BYTES = 1 << 20
MAX_OUTPUT_CHARS = 1 << 22
MAX_RENDER_SECONDS = 2.0
_TEMPLATE_FILE = "<template>"  # the file name jinja2 compiles a template from a string under


class TemplateLimitError(ValueError):
    """A chat template that ran too long or built too much text."""


def _too_big(size: int) -> TemplateLimitError:
    return TemplateLimitError(
        f"the chat template builds a value of {size:,} items, past the limit of {MAX_OUTPUT_CHARS:,}"
    )


def _sized(value) -> int | None:
    return len(value) if isinstance(value, str | list | tuple) else None


def _str_or_none(value) -> str | None:
    return value if isinstance(value, str) else None


def _format_widths(text: str) -> list[int]:
    """Every number written in a format string (widths and precisions among them)."""
    return [int(digits) for digits in re.findall(r"\d{7,}", text)]


def _json_size(value, indent) -> int:
    """An upper bound of json.dumps(value, indent=indent)'s length, from its compact form."""
    compact = json.dumps(value)
    step = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if not step:
        return len(compact) * 2
    depth = deepest = 0
    for bracket in re.finditer(r"[\[\]{}]", compact):
        depth += 1 if bracket.group() in "[{" else -1
        deepest = max(deepest, depth)
    lines = compact.count(",") + compact.count("[") + compact.count("{") + compact.count("]") * 2 + 1
    return len(compact) * 2 + lines * (deepest * step + 1)


def _output_size(name: str, value, args: tuple, kwargs: dict) -> int:
    """An upper bound of what filter or str method `name` returns for these arguments (0: not sized
    from its arguments beyond the plain integer check)."""
    text = _str_or_none(value)
    if name == "replace" and text is not None and len(args) >= 2:
        old, new = str(args[0]), str(args[1])
        count = text.count(old) if old else len(text) + 1
        return len(text) + count * max(0, len(new) - len(old))
    if name == "join" and isinstance(value, list | tuple | str):
        separator = str(args[0] if args else kwargs.get("d", ""))
        items = value if text is None else list(text)
        return sum(len(str(item)) for item in items) + len(separator) * len(items)
    if name == "indent" and text is not None:
        width = args[0] if args else kwargs.get("width", 4)
        step = width if isinstance(width, int) else len(str(width))
        return len(text) + (text.count("\n") + 1) * step
    if name in ("format", "format_map") and text is not None:
        return max(_format_widths(text), default=0)
    if name == "tojson":
        return _json_size(value, args[0] if args else kwargs.get("indent"))
    return 0


def _check_call(name: str, value, args: tuple, kwargs: dict) -> None:
    """Raise TemplateLimitError before a filter or method call whose output could pass the limit:
    an integer argument past it (a width, a fill count) or a size estimated from the inputs."""
    for argument in (*args, *kwargs.values()):
        if isinstance(argument, int) and not isinstance(argument, bool) and argument > MAX_OUTPUT_CHARS:
            raise TemplateLimitError(
                f"the chat template passes {argument:,} to {name}, past the limit of {MAX_OUTPUT_CHARS:,}"
            )
    size = _output_size(name, value, args, kwargs)
    if size > MAX_OUTPUT_CHARS:
        raise TemplateLimitError(
            f"the chat template's {name} would build {size:,} characters, past the limit of "
            f"{MAX_OUTPUT_CHARS:,}"
        )


def _bounded_filter(name: str, function):
    """`function` (a jinja2 filter) with `_check_call` before it; its pass-context marks kept."""
    skip = 1 if hasattr(function, "jinja_pass_arg") else 0  # the context/environment argument

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        _check_call(name, value, rest, kwargs)
        return function(*args, **kwargs)

    return bounded


def compile_chat_template(source: str):
    """A jinja2 template in a bounded sandbox, with the helpers Hugging Face templates call."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if not isinstance(source, str):
        raise TemplateLimitError(f"a chat template must be a str, got {type(source).__name__}")
    if len(source.encode("utf-8")) > MAX_TEMPLATE_BYTES:
        raise TemplateLimitError(
            f"the chat template has {len(source.encode('utf-8')):,} bytes, past the limit of "
            f"{MAX_TEMPLATE_BYTES:,}"
        )

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["+", "*", "**", "%"])

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "a call")
            if name == "join" and isinstance(owner, str) and args:  # sep.join(items): items first
                _check_call(name, args[0], (owner, *args[1:]), kwargs)
            else:
                _check_call(name, owner, args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            if operator == "%" and isinstance(left, str):
                _check_call("%", "", right if isinstance(right, tuple) else (right,), {})
                _check_call("format", left, (), {})
            elif operator == "*":
                for sequence, count in ((left, right), (right, left)):
                    size = _sized(sequence)
                    if size is not None and isinstance(count, int) and size * count > MAX_OUTPUT_CHARS:
                        raise _too_big(size * count)
            elif operator == "+":
                sizes = (_sized(left), _sized(right))
                if None not in sizes and sum(sizes) > MAX_OUTPUT_CHARS:  # type: ignore[arg-type]
                    raise _too_big(sum(sizes))  # type: ignore[arg-type]
            elif isinstance(left, int) and isinstance(right, int) and right > 0:
                bits = abs(left).bit_length() * right
                if bits > 64 * MAX_OUTPUT_CHARS:
                    raise TemplateLimitError(f"the chat template computes {left} ** {right}: too large")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not expect
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters.update({name: _bounded_filter(name, f) for name, f in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def render_chat_template(template, **context) -> str:
    """`template` (from `compile_chat_template`) rendered with `context`, within the limits."""
    deadline = time.perf_counter() + MAX_RENDER_SECONDS

    def check_values(frame) -> None:
        for value in frame.f_locals.values():
            size = _sized(value)
            if size is None and hasattr(value, "_Namespace__attrs"):  # {% set ns.x = … %}
                size = max((_sized(v) or 0 for v in value._Namespace__attrs.values()), default=0)
            if size is not None and size > MAX_OUTPUT_CHARS:
                raise _too_big(size)

    def trace(frame, event, arg):
        if time.perf_counter() > deadline:
            raise TemplateLimitError(f"the chat template ran for more than {MAX_RENDER_SECONDS} s")
        if event == "line" and frame.f_code.co_filename == _TEMPLATE_FILE:
            check_values(frame)
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        pieces, total = [], 0
        for piece in template.generate(**context):
            total += len(piece)
            if total > MAX_OUTPUT_CHARS:
                raise TemplateLimitError(
                    f"the chat template wrote more than {MAX_OUTPUT_CHARS:,} characters"
                )
            pieces.append(piece)
    finally:
        sys.settrace(previous)
    return "".join(pieces)
