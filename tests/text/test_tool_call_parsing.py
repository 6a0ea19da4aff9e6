"""Tool calls as chat templates write them: a template's family (Qwen2.5's is hermes, the bundled
model's renders no tools), calls read back from a reply (several at once; malformed ones leave
the reply as plain content), a stream split so no piece of a call goes out as content, Qwen2.5's
template rendering tools and a replayed call, and the forced-call grammar accepting exactly the
calls the template writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvcache
from kvcache.text.tokenizer import Tokenizer
from kvcache.text.tool_calls import ToolCall, ToolStream, call_grammar, parse_tool_calls, tool_format

TEMPLATE = (Path(__file__).resolve().parent / "qwen25_tools.jinja").read_text(encoding="utf-8")
NAMES = {"get_weather", "get_time"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                          "required": ["city"]}}}


def test_qwens_template_is_hermes_and_the_bundled_one_renders_no_tools():
    assert tool_format(TEMPLATE) == "hermes"
    assert tool_format(kvcache.load_tokenizer().chat_template) is None
    assert tool_format(None) is None
    assert tool_format("{{ tools }} <function_calls>") is None  # (a family kvcache does not read)


def test_several_calls_are_read_with_the_text_beside_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Let me look."
    assert calls == [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", '{"zone": "CET"}')]


def test_a_call_alone_has_no_content_and_arguments_as_text_are_read():
    text = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>'
    assert parse_tool_calls(text, NAMES) == (None, [ToolCall("get_time", '{"zone": "UTC"}')])


@pytest.mark.parametrize("text", [
    "no calls at all",
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"\n</tool_call>',  # not JSON
    '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',  # a function not offered
    '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_time", "arguments": {}}',  # left open (cut by max_tokens)
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><tool_call>\n{"name": ',  # one good
])
def test_a_malformed_reply_is_plain_content(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def _streamed(pieces: list[str]) -> tuple[str, str, list[ToolCall]]:
    stream = ToolStream(NAMES)
    sent = "".join(stream.feed(piece) for piece in pieces)
    held, calls = stream.finish()
    return sent, held, calls


def test_a_stream_sends_content_before_a_call_and_never_a_piece_of_the_call():
    reply = 'Sure.<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    sent, held, calls = _streamed([reply[i:i + 3] for i in range(0, len(reply), 3)])
    assert sent == "Sure." and held == "" and calls == [ToolCall("get_time", '{"zone": "UTC"}')]


def test_a_stream_whose_call_is_malformed_sends_all_of_it_as_content():
    reply = "a <tool_ b <tool_call> not json </tool_call> c"
    sent, held, calls = _streamed(list(reply))
    assert sent + held == reply and calls == []
    assert sent == "a <tool_ b "  # (held from "<tool_call>" on; a lookalike went out once it was not one)


def test_qwens_template_renders_the_tools_and_a_replayed_call_as_it_is_generated():
    base = kvcache.load_tokenizer()
    tokenizer = Tokenizer(base.backend, base.special_tokens, TEMPLATE, base.add_bos_token)
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    text = tokenizer.render_chat(history, add_generation_prompt=True, tools=[WEATHER])
    assert json.dumps(WEATHER) in text and "<tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("parallel", [False, True])
def test_the_forced_call_grammar_takes_the_calls_the_template_writes(parallel):
    import llguidance

    base = kvcache.load_tokenizer()
    table = llguidance.LLTokenizer(base.backend.to_str(), n_vocab=base.vocab_size,
                                   eos_token=[base.eos_token_id])
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    grammar = llguidance.LLMatcher.grammar_from_lark(call_grammar([WEATHER], parallel))

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        return all(matcher.consume_token(t) for t in base.encode(text, add_special_tokens=False)) and \
            matcher.is_accepting()

    assert accepts(call)
    assert accepts(call + "\n" + call) == parallel
    assert not accepts(call.replace("get_weather", "get_time"))
    assert not accepts(call.replace('"Oslo"', "7"))
    assert not accepts(call.replace('", "', '","'))  # (compact JSON is not how the template writes it)
