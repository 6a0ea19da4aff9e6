"""What the tests read from a streamed chat completion of the official `openai` client."""

from __future__ import annotations


def streamed_logprobs(stream) -> tuple[list, list[str], object]:
    """(every chunk's logprob items in order, every chunk's content text, the usage chunk's usage)
    of a streamed chat completion asked with logprobs and stream_options include_usage."""
    items, text, usage = [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            items.extend(choice.logprobs.content if choice.logprobs else [])
    return items, text, usage
