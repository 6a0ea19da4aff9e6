"""A reply's reasoning split from its answer, as vLLM's and llama-server's reasoning parsers split
it: the text of a `<think>…</think>` block (the markers of the Qwen3 and DeepSeek-R1 chat template
family) goes to `reasoning_content`, the text after it to `content`.

The split applies only when the chat template knows the markers (`reasoning_format`), and the
block is the reply's first text: either the reply opens it (`<think>`, after whitespace) or the
prompt already did (a generation prompt ending in an open `<think>`, as DeepSeek-R1's and Qwen3's
thinking templates write it: `opens_in_reasoning`). A reply with no block is all content, as it
came. A block left open (cut by max_tokens) is all reasoning. As the templates read a reply back
into the history (`content.split('</think>')[-1].lstrip('\\n')`, `reasoning.strip('\\n')`), the
newlines around the reasoning and before the answer are dropped.

`ReasoningStream` splits a streamed reply piece by piece, holding only what could still be part
of a marker (or newlines it may drop); its pieces joined are `split_reasoning`'s answer.
"""

from __future__ import annotations

from kvcache.text.tool_calls import partial_marker

OPEN, CLOSE = "<think>", "</think>"
FAMILIES = ("think",)


def reasoning_format(template: str | None) -> str | None:
    """The reasoning family of a chat template's source (one of FAMILIES), or None when it writes
    no reasoning markers (a reply is then never split)."""
    return "think" if template and CLOSE in template else None


def opens_in_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` block (the reply starts reasoning)."""
    return prompt.rfind(OPEN) > prompt.rfind(CLOSE)


def split_reasoning(text: str, started: bool) -> tuple[str | None, str]:
    """(reasoning, content) of a whole reply; reasoning None when it has no block (content is then
    `text` as it is). `started`: the prompt opened the block (`opens_in_reasoning`)."""
    stream = ReasoningStream(started)
    reasoning, content = stream.feed(text)
    rest_reasoning, rest_content = stream.finish()
    return (reasoning + rest_reasoning if stream.opened else None), content + rest_content


class ReasoningStream:
    """A reply split as it streams: `feed(piece)` -> (reasoning, content) that may go out now;
    `finish()` -> what was held, once the reply is whole. `opened`: a block was opened."""

    def __init__(self, started: bool) -> None:
        self.state = "reasoning" if started else "start"  # start, reasoning, after, content
        self.opened = started
        self.held = ""
        self._reasoned = False  # some reasoning text went out (leading newlines are dropped before)

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        reasoning = content = ""
        while True:
            if self.state == "start":
                text = self.held.lstrip()
                if text.startswith(OPEN):
                    self.held, self.state, self.opened = text[len(OPEN):], "reasoning", True
                    continue
                if OPEN.startswith(text):  # (whitespace only, or the start of <think>: wait)
                    return reasoning, content
                self.state = "content"
            elif self.state == "reasoning":
                at = self.held.find(CLOSE)
                if at >= 0:
                    reasoning += self._reasoning(self.held[:at], end=True)
                    self.held, self.state = self.held[at + len(CLOSE):], "after"
                    continue
                ready = self.held[: len(self.held) - partial_marker(self.held, (CLOSE,))].rstrip("\n")
                reasoning += self._reasoning(ready)
                self.held = self.held[len(ready):]
                return reasoning, content
            elif self.state == "after":
                self.held = self.held.lstrip("\n")
                if not self.held:
                    return reasoning, content
                self.state = "content"
            else:
                content, self.held = content + self.held, ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) still held: a block left open is reasoning to its end; text that
        might have begun `<think>` is content."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return self._reasoning(held, end=True), ""
        return "", ("" if self.state == "after" else held)

    def _reasoning(self, text: str, end: bool = False) -> str:
        if not self._reasoned:
            text = text.lstrip("\n")
        if end:
            text = text.rstrip("\n")
        self._reasoned = self._reasoned or bool(text)
        return text
