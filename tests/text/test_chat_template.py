"""Chat templates are a stranger's programs: rendered in jinja2's sandbox within a time and a size
limit, so a template that loops forever or doubles a string is refused, in bounded time and
memory, with a named error; ordinary templates render as before."""

from __future__ import annotations

import json

import pytest

from kvcache.text.chat_template import (
    MAX_OUTPUT_CHARS,
    MAX_TEMPLATE_BYTES,
    TemplateLimitError,
    compile_chat_template,
    render_chat_template,
)

HOSTILE = {
    "nested loops": "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "doubling with + in a namespace": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                                      "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s|length }}",
    "doubling in a recursive macro": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% else %}"
                                     "{{ s|length }}{% endif %}{% endmacro %}{{ d('ab', 40) }}",
    "repetition": "{{ ('x' * 1000000000)|length }}",
    "list repetition": "{{ ([1] * 1000000000)|length }}",
    "huge power": "{{ (10 ** 100000000) % 7 }}",
    "namespace doubling": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                          "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "long output": "{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}",
    # one call that allocates from an argument: refused before it runs
    "center": "{{ 'x'|center(2**34) }}",
    "center method": "{{ 'x'.center(2**34) }}",
    "ljust method by keyword": "{{ 'x'.ljust(width=2**34) }}",
    "tojson indent": "{{ [[1, 2], {'a': 3}]|tojson(indent=2**33) }}",
    "tojson indent string": "{% set s = 'x' * 4000000 %}{{ [[[[1, 2, 3]]]]|tojson(indent=s) }}",
    "format filter width": "{{ '%2000000000d'|format(1) }}",
    "percent width": "{{ '%2000000000d' % 1 }}",
    "percent star width": "{{ '%*d' % (2**34, 1) }}",
    "str.format width": "{{ '{:2000000000}'.format(1) }}",
    "replace growth": "{{ ('x' * 4000000)|replace('x', 'yy') }}",
    "replace of the empty string": "{{ ('x' * 3000)|replace('', 'y' * 3000) }}",
    "join of many": "{{ (['a' * 1000000] * 100)|join }}",
    "join method": "{{ ('-' * 100).join(['a' * 1000000] * 100) }}",
    "indent width": "{{ ('a\n' * 1000)|indent(2**32) }}",
    "indent string": "{% set w = 'x' * 10000 %}{{ ('a\n' * 1000)|indent(w) }}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_a_hostile_template_is_refused_in_bounded_time(name):
    template = compile_chat_template(HOSTILE[name])
    with pytest.raises(TemplateLimitError, match="chat template"):  # unbounded, it would never return
        render_chat_template(template, messages=[])


def test_a_template_too_large_is_refused_before_it_is_compiled():
    with pytest.raises(TemplateLimitError, match="bytes, past the limit"):
        compile_chat_template("x" * (MAX_TEMPLATE_BYTES + 1))


def test_an_ordinary_template_renders_as_jinja_renders_it():
    source = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n{% endfor %}"
              "{% if add_generation_prompt %}<|assistant|>{% endif %}{{ (['a'] * 3) | join(',') }}")
    text = render_chat_template(compile_chat_template(source), add_generation_prompt=True,
                                messages=[{"role": "user", "content": " hi "}])
    assert text == "<|user|>hi\n<|assistant|>a,a,a"
    assert MAX_OUTPUT_CHARS >= 1 << 20  # room for any real prompt


def test_the_sized_filters_still_render_ordinary_arguments():
    source = ("{{ tools|tojson(indent=4) }}|{{ '%5d' % 42 }}|{{ '%-4s|'|format('a') }}"
              "|{{ '{:>4}'.format('b') }}|{{ ['x', 'y']|join(', ') }}|{{ ', '.join(['p', 'q']) }}"
              "|{{ 'a\nb'|indent(2) }}"
              "|{{ 'ab'|replace('a', 'cc') }}|{{ 'z'|center(5) }}|")
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}]
    text = render_chat_template(compile_chat_template(source), tools=tools)
    assert text == (json.dumps(tools, indent=4) + "|   42|a   ||   b|x, y|p, q|a\n  b|ccb|  z  |")
