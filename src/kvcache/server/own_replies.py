"""An opt-in repair of prefix-cache misses (`kvcache serve --restore-reasoning`, off by default): the
text each chat reply held before its content (its `<think>` block as the model wrote it) is
remembered by what the reply answered (the messages, the chat template's variables) and by its
content. A later chat request whose history holds that reply without its reasoning (as many clients
send it back) gets the reasoning put back in front of the content before the template renders it,
so the prompt holds the reply as the server made it and matches the prefix cache up to where the
template itself renders the history otherwise.

An assistant message that carries reasoning (a `<think>` in its content, or `reasoning_content`) is
never changed, nor one the server has no reasoning of: a request that sends the history back as the
server made it renders the same tokens with the repair on or off."""

from __future__ import annotations

import collections
import hashlib
import json
import threading

from kvcache.server.reasoning import CLOSE, OPEN, split_reasoning

REASONING_FIELDS = ("reasoning_content", "reasoning")  # an assistant message's reasoning, sent apart
REMEMBERED = 256  # replies kept (as many as the explainer keeps prompts)


class OwnReplies:
    """The reasoning of the last `capacity` chat replies (the oldest forgotten first), and the
    histories they are put back into. Messages are keyed as a client that drops reasoning sends
    them (each assistant message by its content after any `<think>` block, stripped), so a history
    keys alike whether its reasoning was dropped, sent back or put back here."""

    def __init__(self, capacity: int = REMEMBERED) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (replies remembered), got {capacity}")
        self.capacity = capacity
        self._heads: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._heads)

    def remember(self, messages: list[dict], variables: dict, text: str, started: bool,
                 content: str | None) -> None:
        """Remember the reply to `messages` (rendered with `variables`): `text` as the model wrote it,
        `content` the message content the client was sent (its tool calls read out; the reasoning
        split off, or not). Nothing is kept for a reply without a closed reasoning block, or one
        whose block the prompt opened (`started`: no text of the reply's own holds its opening)."""
        if started:
            return
        reasoning, rest = split_reasoning(text, False)
        head = text[: len(text) - len(rest)]  # the block and the newlines after it
        if reasoning is None or CLOSE not in head:
            return
        visible = (content or "").removeprefix(head)  # (a reply not split holds its block)
        key = _history_key(messages, variables)
        key.update(_content(visible.strip()))
        with self._lock:
            self._heads[key.digest()] = head
            self._heads.move_to_end(key.digest())
            while len(self._heads) > self.capacity:
                self._heads.popitem(last=False)

    def restore(self, messages: list[dict], variables: dict) -> list[dict]:
        """`messages` with each assistant message that carries no reasoning, and answered the same
        history as a remembered reply with the same content, given that reply's reasoning back;
        `messages` itself (the same list) when none is."""
        key, restored = _history_key([], variables), None
        for index, message in enumerate(messages):
            content = message.get("content")
            if message.get("role") == "assistant" and _bare(message):
                found = key.copy()
                found.update(_content((content or "").strip()))
                with self._lock:
                    head = self._heads.get(found.digest())
                if head is not None:
                    restored = restored or list(messages)
                    restored[index] = {**message, "content": head + (content or "").lstrip("\n")}
            key.update(_content(_dropped(message)))
        return messages if restored is None else restored


def _bare(message: dict) -> bool:
    """Whether an assistant message carries no reasoning: text content (or none) without `<think>`
    and no reasoning field."""
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        return False
    return OPEN not in (content or "") and not any(field in message for field in REASONING_FIELDS)


def _dropped(message: dict) -> dict:
    """`message` as a client that drops reasoning sends it (an assistant's content after its block,
    stripped; no reasoning field)."""
    if message.get("role") != "assistant":
        return message
    kept = {name: value for name, value in message.items() if name not in REASONING_FIELDS}
    content = kept.get("content")
    if content is None or isinstance(content, str):  # (a tool call's message may have none)
        kept["content"] = split_reasoning(content or "", False)[1].strip()
    return kept


def _history_key(messages: list[dict], variables: dict):
    key = hashlib.blake2b(_content(variables), digest_size=16)
    for message in messages:
        key.update(_content(_dropped(message)))
    return key


def _content(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=repr).encode() + b"\x00"
