"""A request's choices: the `n` children of one request, each an engine request of its own over the
same prompt, their blocks shared; and one choice's reply read into what it answers (its reasoning,
its content, its tool calls), whole or as it streams.

Sharing is the prefix cache's: the first child is submitted alone, the others once the first's
prompt is in the KV cache (its first token came, or it ended). Each of them then attaches the
prompt's blocks (the part of a block past the whole ones is copied on its first write, when the
pool can) and computes at most the prompt's tokens past its last whole block: one prefill of the
prompt for all of them. Child i samples
with the request's seed + i, so with a seed the children differ and the whole answer is
reproducible (without one, each samples at random).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

from kvcache.engine import SamplingParams
from kvcache.server.reasoning import ReasoningStream, split_reasoning
from kvcache.text.tool_calls import ToolCall, ToolStream, parse_tool_calls

END = object()  # the token of a child's last update: it ended


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s sampling: the request's, its seed (when it has one) moved by `index`."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (1 << 63))


class Choices:
    """The handles of one request's children. `submit(params, index)` submits child `index` (the
    first at once, here; the others from `updates`, once the first's prompt is cached)."""

    def __init__(self, submit: Callable[[SamplingParams, int], object], params: SamplingParams,
                 n: int) -> None:
        self.submit, self.params, self.n = submit, params, n
        self.handles = [submit(params, 0)]

    async def updates(self):
        """(index, token, piece): each child's updates as they come, then (index, END, None) when
        child `index` has ended."""
        if self.n == 1:
            async for token, piece in self.handles[0].updates():
                yield 0, token, piece
            yield 0, END, None
            return
        queue: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(_pump(0, self.handles[0], queue))]
        ended = 0
        try:
            while ended < self.n:
                index, token, piece = await queue.get()
                if len(self.handles) < self.n:  # the first child's prompt is cached now: share it
                    for child in range(1, self.n):
                        self.handles.append(self.submit(child_params(self.params, child), child))
                        tasks.append(asyncio.create_task(_pump(child, self.handles[child], queue)))
                ended += token is END
                yield index, token, piece
        finally:
            for task in tasks:
                task.cancel()

    def cancel(self) -> None:
        """Cancel every child not yet done."""
        for handle in self.handles:
            if not handle.done:
                handle.cancel()

    def results(self) -> list:
        """Each child's Completion, in order (once they all ended)."""
        return [handle.result() for handle in self.handles]


async def _pump(index: int, handle, queue: asyncio.Queue) -> None:
    try:
        async for token, piece in handle.updates():
            queue.put_nowait((index, token, piece))
    finally:
        queue.put_nowait((index, END, None))


def reads_calls(call) -> bool:
    """Whether a chat reply is read for tool calls: tools offered and tool_choice not "none"."""
    return call.tools is not None and call.tools.choice != "none"


def read_reply(call, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
    """(reasoning, content, tool calls) of a whole reply: reasoning None when the reply is not split
    or had no block; content None when it is empty beside reasoning or calls."""
    reasoning = None
    if call.reasoning is not None:
        reasoning, text = split_reasoning(text, call.reasoning)
    calls: list[ToolCall] = []
    if reads_calls(call):
        content, calls = parse_tool_calls(text, call.tools.names, call.tools.family)
        text = content if calls else text
    return reasoning, (text or None) if reasoning is not None or calls else text, calls


class ChoiceStream:
    """One choice's reply as it streams: `feed(piece)` -> (reasoning, content) that may go out now
    (reasoning split off, text held from a `<tool_call>` on); `finish()` -> (reasoning, content,
    calls) still held. Counts the tokens made and those whose logprobs went out."""

    def __init__(self, call) -> None:
        self.reasoning = None if call.reasoning is None else ReasoningStream(call.reasoning)
        self.calls = ToolStream(call.tools.names, call.tools.family) if reads_calls(call) else None
        self.tokens = self.sent = self.offset = 0  # tokens made, those whose logprobs went out, text sent

    def feed(self, piece: str) -> tuple[str, str]:
        reasoning, content = ("", piece) if self.reasoning is None else self.reasoning.feed(piece)
        return reasoning, content if self.calls is None else self.calls.feed(content)

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        if self.calls is None:
            return reasoning, content, []
        out = self.calls.feed(content)
        held, calls = self.calls.finish()
        return reasoning, out + held, calls
