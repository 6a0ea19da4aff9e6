"""The server's segments of a chat prompt for the prefix-miss explainer (kvcache.server.why): the
tools a template writes into the system message are a segment of their own (so tools sent in
another order are named as such), and the renders of a conversation's message prefixes are
remembered, so its next turn renders only its new messages. A toy template, one token a character."""

import json
from types import SimpleNamespace

from kvcache.reuse.explain import PrefixExplainer, Segment
from kvcache.server.why import PrefixRenders, RequestExplainer, tools_segment

BLOCK = 4
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
         for name in ("read_file", "run_tests", "search")]
CHAT = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix the test."}]


class ToyTokenizer:
    """Writes the tools into the first message as Qwen2.5's template does: after its text, one JSON
    object a line. Counts its renders."""

    def __init__(self) -> None:
        self.renders = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None):
        self.renders += 1
        text = ""
        for index, message in enumerate(messages):
            content = message["content"]
            if index == 0 and tools:
                content += "\n# Tools\n" + "\n".join(json.dumps(tool) for tool in tools)
            text += f"<|{message['role']}|>{content}<|end|>"
        return [ord(c) for c in text + ("<|assistant|>" if add_generation_prompt else "")]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def segments_of(renders: PrefixRenders, messages: list[dict], tools: list | None) -> tuple[list[int], list]:
    """The prompt's ids and segments as RequestExplainer.segments makes them."""
    kwargs = {"tools": tools} if tools else {}
    ids = renders.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    found, start = [], 0
    for index, end in enumerate(renders.lengths(messages, kwargs)):
        found.append(Segment("system" if index == 0 else f"message {index}", start, end))
        start = end
    found.append(Segment("generation prompt", start, len(ids)))
    return ids, tools_segment(found, *renders.tools(messages[0], kwargs))


def test_the_tools_written_into_the_system_message_are_their_own_segment():
    renders = PrefixRenders(ToyTokenizer())
    ids, segments = segments_of(renders, CHAT, TOOLS)
    text = renders.tokenizer.decode(ids)
    names = [segment.name for segment in segments]
    assert names == ["system", "tools", "system", "message 1", "generation prompt"]
    tools = segments[1]
    assert text[tools.start: tools.end] == "\n# Tools\n" + "\n".join(json.dumps(tool) for tool in TOOLS)
    assert text[: tools.start] == "<|system|>You are an agent." and segments[2].end == segments[3].start


def test_tools_sent_in_another_order_are_named_reordered_in_the_tools_segment():
    renders = PrefixRenders(ToyTokenizer())
    explain = PrefixExplainer(BLOCK, decode=renders.tokenizer.decode)
    old, old_segments = segments_of(renders, CHAT, TOOLS)
    explain.record(old, segments=old_segments)
    ids, segments = segments_of(renders, CHAT, TOOLS[1:] + TOOLS[:1])
    answer = explain.explain(ids, segments=segments)
    assert (answer.cause, answer.segment) == ("tools_reordered", "tools")


def test_a_template_that_writes_no_tools_leaves_the_segments_as_they_are():
    segments = [Segment("system", 0, 10), Segment("generation prompt", 10, 14)]
    assert tools_segment(segments, [1, 2, 3], [1, 2, 3]) == segments
    assert tools_segment(segments, [], []) == segments


def test_the_next_turn_of_a_conversation_renders_only_its_new_messages():
    tokenizer = ToyTokenizer()
    renders = PrefixRenders(tokenizer)
    first = renders.lengths(CHAT, {"tools": TOOLS})
    assert tokenizer.renders == len(CHAT)
    turn = [*CHAT, {"role": "assistant", "content": "Reading it."}, {"role": "user", "content": "ok"}]
    lengths = renders.lengths(turn, {"tools": TOOLS})
    assert tokenizer.renders == len(turn) and lengths[:2] == first
    assert lengths == [len(tokenizer.apply_chat_template(turn[:end], tools=TOOLS)) for end in (1, 2, 3, 4)]
    renders.lengths(CHAT, {})  # other template variables: rendered again
    assert tokenizer.renders == len(turn) + 4 + len(CHAT)


def test_the_record_of_renders_is_bounded():
    renders = PrefixRenders(ToyTokenizer(), capacity=3)
    for index in range(10):
        renders.lengths([{"role": "user", "content": f"message {index}"}], {})
    assert len(renders) == 3


def test_a_history_rendered_after_its_reply_leaves_the_next_turn_one_render():
    """RequestExplainer.warm (run after a reply) renders the whole history, so the next turn's hit,
    named in the message after it, renders only the prefix that ends that message."""
    tokenizer = ToyTokenizer()
    why = RequestExplainer(SimpleNamespace(limits=SimpleNamespace(block_size=BLOCK)), tokenizer)
    kwargs = {"tools": TOOLS}
    why.explain(CHAT, tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, **kwargs), None, kwargs)
    why.warm(CHAT, kwargs)
    turn = CHAT + [{"role": "assistant", "content": "Reading it."}, {"role": "user", "content": "Go on."}]
    ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, **kwargs)
    before = tokenizer.renders
    found = why.explain(turn, ids, None, kwargs)
    assert (found.cause, found.segment) == ("hit", "message 2")
    assert tokenizer.renders - before == 1
