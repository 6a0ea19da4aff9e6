"""The tool-call families besides hermes, each from a small template (tests/text/*_tools.jinja) that
renders tools and a replayed call as that family's real template does: mistral (`[TOOL_CALLS] [{...}]`,
several calls in one list) and llama3 (the whole reply one `{"name", "parameters"}` object, perhaps
after `<|python_tag|>`). For each: the template's source names its family, whole replies are read
(content beside mistral's calls, several calls where the family allows them), malformed calls stay
content, a stream holds only what may be part of a call (split at every character), and the
forced-call grammar takes the call the template writes back and refuses a malformed one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvcache
from kvcache.text.tokenizer import Tokenizer
from kvcache.text.tool_calls import (
    FAMILIES,
    ToolCall,
    ToolStream,
    call_grammar,
    parse_tool_calls,
    tool_format,
)

NAMES = {"get_weather", "get_time"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}}}
PARIS, UTC = ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "UTC"}')

HERE = Path(__file__).resolve().parent
MISTRAL = (HERE / "mistral_tools.jinja").read_text(encoding="utf-8")  # (as Mistral-7B-Instruct-v0.3's)
LLAMA3 = (HERE / "llama3_tools.jinja").read_text(encoding="utf-8")  # (as Llama-3.1's)

MISTRAL_CALL = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def test_each_family_is_known_by_its_templates_source():
    assert tool_format(MISTRAL) == "mistral"
    assert tool_format(LLAMA3) == "llama3"
    assert set(FAMILIES) == {"hermes", "mistral", "llama3"}


@pytest.mark.parametrize("template, call", [(MISTRAL, MISTRAL_CALL), (LLAMA3, LLAMA3_CALL)])
def test_the_template_writes_a_replayed_call_as_the_family_reads_it(template, call):
    base = kvcache.load_tokenizer()
    tokenizer = Tokenizer(base.backend, base.special_tokens, template, base.add_bos_token)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "abcdefghi", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "abcdefghi", "content": "21 C"},
               {"role": "user", "content": "And now?"}]
    text = tokenizer.render_chat(history, add_generation_prompt=True, tools=[WEATHER])
    assert json.dumps(WEATHER) in text and call in text and "21 C" in text


def test_mistral_reads_several_calls_and_the_content_before_them():
    text = ('Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}]')
    assert parse_tool_calls(text, NAMES, "mistral") == ("Let me look.", [PARIS, UTC])
    assert parse_tool_calls(MISTRAL_CALL, NAMES, "mistral") == (None, [PARIS])
    # (the marker is a special token Mistral's tokenizers write, which a detokenized reply drops)
    assert parse_tool_calls(MISTRAL_CALL[len("[TOOL_CALLS]"):], NAMES, "mistral") == (None, [PARIS])


def test_llama3_reads_one_object_with_or_without_the_python_tag():
    assert parse_tool_calls(LLAMA3_CALL, NAMES, "llama3") == (None, [PARIS])
    assert parse_tool_calls("<|python_tag|>" + LLAMA3_CALL + "\n", NAMES, "llama3") == (None, [PARIS])
    assert parse_tool_calls('{"name": "get_time", "arguments": {"zone": "UTC"}}', NAMES, "llama3") == \
        (None, [UTC])  # (the arguments under the key other families use are read too)


@pytest.mark.parametrize("family, text", [
    ("mistral", "no calls at all"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),  # cut short
    ("mistral", '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]'),  # a function not offered
    ("mistral", '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"arguments": {}}]'),  # one nameless
    ("mistral", '[TOOL_CALLS] {"name": "get_time", "arguments": {}}'),  # not a list
    ("mistral", "[TOOL_CALLS] []"),
    ("mistral", "[1, 2]"),  # (a bare list that is not calls)
    ("mistral", 'See [{"name": "get_time", "arguments": {}}]'),  # (a bare list only opens a reply)
    ("llama3", "The weather is fine."),
    ("llama3", 'Here: {"name": "get_weather", "parameters": {"city": "Paris"}}'),  # text before it
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}'),  # cut short
    ("llama3", '{"name": "get_weather", "parameters": [1]}'),  # parameters not an object
    ("llama3", '{"name": "launch", "parameters": {}}'),
    ("llama3", LLAMA3_CALL + "; " + LLAMA3_CALL),  # (one call a reply)
])
def test_a_malformed_reply_is_plain_content(family, text):
    assert parse_tool_calls(text, NAMES, family) == (text, [])


def _streamed(pieces: list[str], family: str) -> tuple[str, str, list[ToolCall]]:
    stream = ToolStream(NAMES, family)
    sent = "".join(stream.feed(piece) for piece in pieces)
    held, calls = stream.finish()
    return sent, held, calls


@pytest.mark.parametrize("family, reply, content, calls", [
    ("mistral", "Sure. " + MISTRAL_CALL, "Sure. ", [PARIS]),
    ("mistral", "a [TOOL_ b [TOOL_CALLS] [not json]", None, []),
    ("mistral", " " + MISTRAL_CALL[len("[TOOL_CALLS] "):], "", [PARIS]),
    ("mistral", "[1, 2] and more", None, []),
    ("llama3", "\n<|python_tag|>" + LLAMA3_CALL, "", [PARIS]),
    ("llama3", LLAMA3_CALL, "", [PARIS]),
    ("llama3", " <|python_x {}", None, []),
    ("llama3", '{"name": "get_weather"', None, []),
])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_stream_sends_content_before_a_call_and_never_a_piece_of_it(family, reply, content, calls, size):
    sent, held, read = _streamed([reply[i:i + size] for i in range(0, len(reply), size)], family)
    assert read == calls
    if calls:
        assert sent == content and held == ""
    else:
        assert sent + held == reply  # (a malformed call goes out as content once the reply is whole)


def test_a_stream_sends_text_that_cannot_begin_a_call_at_once():
    stream = ToolStream(NAMES, "mistral")
    assert stream.feed("Hello [TOOL_") == "Hello " and stream.feed("X]") == "[TOOL_X]"
    assert stream.feed(" [") == " "  # (only what may begin the marker is held once text went out)
    stream = ToolStream(NAMES, "llama3")
    assert stream.feed("  <|py") == "" and stream.feed("x") == "  <|pyx"
    assert stream.feed(" {") == " {"  # (after text, a brace begins no call)


@pytest.mark.parametrize("family, call, several", [
    ("mistral", MISTRAL_CALL, MISTRAL_CALL[:-1] + ", " + MISTRAL_CALL[len("[TOOL_CALLS] ["):]),
    ("llama3", LLAMA3_CALL, LLAMA3_CALL + "; " + LLAMA3_CALL),
])
@pytest.mark.parametrize("parallel", [False, True])
def test_the_forced_call_grammar_takes_the_call_the_template_writes(family, call, several, parallel):
    import llguidance

    base = kvcache.load_tokenizer()
    table = llguidance.LLTokenizer(base.backend.to_str(), n_vocab=base.vocab_size,
                                   eos_token=[base.eos_token_id])
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar([WEATHER, TIME], parallel, family))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in base.encode(text, add_special_tokens=False)) and \
            matcher.is_accepting()

    assert accepts(call) and parse_tool_calls(call, NAMES, family)[1] == [PARIS]
    assert accepts(several) == (parallel and family == "mistral")  # (llama3: one call a reply)
    assert not accepts(call.replace("get_weather", "launch"))
    assert not accepts(call.replace('"Paris"', "7"))
    assert not accepts(call.replace('", "', '","'))  # (compact JSON is not how the template writes it)
    key = "arguments" if family == "mistral" else "parameters"
    assert not accepts(call.replace(key, "args"))
