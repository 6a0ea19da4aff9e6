"""The server's side of the prefix-miss explainer (`kvcache.reuse.explain`): a chat request's
segments (system, message k, generation prompt) as token ranges, what the engine's KV pool holds,
and the explanations of recent requests by response id (for `GET /v1/why/{id}`). It reads the
prompt; it never changes what is submitted."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
from collections.abc import Iterator

from kvcache.blocks import salt_root
from kvcache.blocks.allocator import common_prefix
from kvcache.engine import Engine
from kvcache.reuse.explain import CONTEXT_TOKENS, Explanation, PrefixExplainer, Segment

REMEMBERED = 256  # prompts (with their replies) and explanations by id kept


class RequestExplainer:
    """Explains each prompt against the ones before it, then remembers it. Only the engine's KV
    pool (memory) is asked whether a block is still held; a block a lower tier still holds is
    loaded by the engine and counted in cached_tokens, not here."""

    def __init__(self, engine, tokenizer, capacity: int = REMEMBERED) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        decode = None if tokenizer is None else tokenizer.decode
        # (each prompt and, once it is answered, the prompt with its reply)
        self.explainer = PrefixExplainer(engine.limits.block_size, 2 * capacity, decode=decode)
        self._lock = threading.Lock()
        self._by_id: collections.OrderedDict[str, tuple[Explanation, list[int]]] = collections.OrderedDict()
        self._capacity = capacity
        self.renders = PrefixRenders(tokenizer)

    def explain(self, prompt, ids: list[int], cache_salt: str | None,
                template_kwargs: dict | None = None) -> Explanation:
        """The explanation of `ids` (rendered from `prompt` with the chat template's further variables
        `template_kwargs`: the tools offered, chat_template_kwargs) under `cache_salt`; then remembers it."""
        segments = self.lazy_segments(prompt, len(ids), template_kwargs)
        root = salt_root(cache_salt)
        held = None  # (replicas: each holds its own pool, not asked here; what was seen counts as held)
        if isinstance(self.engine, Engine):
            allocator = self.engine.pool.cache.allocator
            held = lambda digest: allocator.attachable([digest]) == 1  # noqa: E731
        with self._lock:  # (segments are read here only, a remembered prompt's too: under the lock)
            return self.explainer.observe(ids, root, segments, held=held)

    def reply(self, prompt, ids: list[int], reply: list[int], cache_salt: str | None,
              template_kwargs: dict | None = None) -> None:
        """Remember what the server holds after answering `ids` (rendered from `prompt`, explained
        before) with the tokens `reply`: a next turn that sends the reply back is compared with it."""
        segments = self.lazy_segments(prompt, len(ids), template_kwargs)
        with self._lock:
            self.explainer.record_reply(ids, reply, salt_root(cache_salt), segments)

    def warm(self, prompt, template_kwargs: dict | None = None) -> None:
        """Render a chat's whole history (without a generation prompt) and keep its length: the
        next turn's explanation reads the segment after it. For after a reply, off the event loop
        (on a preparing thread): the render is then not on the next turn's way to its first token."""
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        if chat and self.tokenizer is not None:
            self.renders.whole_length(prompt, template_kwargs or {})

    def segments(self, prompt, length: int, template_kwargs: dict | None = None) -> list[Segment]:
        """Token ranges of a chat prompt's messages (each rendered prefix's length, with the tools and
        template variables the prompt had), the tools the template wrote into the first message, the
        rest the generation prompt; none for a text or token prompt."""
        return list(self.lazy_segments(prompt, length, template_kwargs))

    def lazy_segments(self, prompt, length: int, template_kwargs: dict | None = None):
        """`segments`, found as they are read (`ChatSegments`): the explainer reads them only as far
        as the index it names, so a prompt renders only the message prefixes before that index."""
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        if not chat or self.tokenizer is None:
            return ()
        return ChatSegments(self.renders, prompt, length, template_kwargs or {})

    def keep(self, rid: str, answer: Explanation, ids: list[int]) -> None:
        """Remember `answer` for response `rid` (the oldest forgotten past capacity)."""
        with self._lock:
            self._by_id[rid] = (answer, ids)
            while len(self._by_id) > self._capacity:
                self._by_id.popitem(last=False)

    def context(self, rid: str) -> dict | None:
        """Response `rid`'s explanation with the decoded tokens either side of its divergence, or None
        when it is not remembered."""
        with self._lock:
            found = self._by_id.get(rid)
        if found is None:
            return None
        answer, ids = found
        at = answer.first_divergent_token
        body = {"id": rid, **answer.as_dict()}
        if at is not None and self.tokenizer is not None:
            body["before"] = self.tokenizer.decode(ids[max(0, at - CONTEXT_TOKENS): at])
            body["after"] = self.tokenizer.decode(ids[at: at + CONTEXT_TOKENS])
        return body


class PrefixRenders:
    """What rendering a chat's message prefixes gives (token lengths; the tokens the tools add to
    the first message), remembered by the messages' and the template variables' content in a
    bounded record: the next turn of a conversation renders only its new messages. Exact: a
    prefix's render depends on nothing else."""

    def __init__(self, tokenizer, capacity: int = 4096) -> None:
        self.tokenizer, self.capacity = tokenizer, capacity
        self._found: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._found)

    def lengths(self, messages: list[dict], kwargs: dict) -> list[int]:
        """The token length of each prefix messages[:k+1] rendered without a generation prompt."""
        return list(self.each_length(messages, kwargs))

    def each_length(self, messages: list[dict], kwargs: dict) -> Iterator[int]:
        """`lengths`, one prefix at a time: a prefix is rendered (or looked up) only when read."""
        key = _keyed(b"lengths", kwargs)
        for index, message in enumerate(messages):
            key.update(_content(message))
            yield self._remembered(key.digest(), lambda end=index + 1: len(
                self.tokenizer.apply_chat_template(messages[:end], add_generation_prompt=False, **kwargs)))

    def whole_length(self, messages: list[dict], kwargs: dict) -> int:
        """`lengths`' last: all of `messages` rendered without a generation prompt (remembered)."""
        key = _keyed(b"lengths", kwargs)
        for message in messages:
            key.update(_content(message))
        return self._remembered(key.digest(), lambda: len(
            self.tokenizer.apply_chat_template(messages, add_generation_prompt=False, **kwargs)))

    def tools(self, first: dict, kwargs: dict) -> tuple[list[int], list[int]]:
        """The first message rendered with kwargs' tools and without them (both empty when none)."""
        if not kwargs.get("tools"):
            return [], []
        key = _keyed(b"tools", kwargs)
        key.update(_content(first))
        bare = {name: value for name, value in kwargs.items() if name != "tools"}
        return self._remembered(key.digest(), lambda: (
            self.tokenizer.apply_chat_template([first], add_generation_prompt=False, **kwargs),
            self.tokenizer.apply_chat_template([first], add_generation_prompt=False, **bare)))

    def _remembered(self, key: bytes, make):
        with self._lock:
            if key in self._found:
                self._found.move_to_end(key)
                return self._found[key]
        made = make()
        with self._lock:
            self._found[key] = made
            while len(self._found) > self.capacity:
                self._found.popitem(last=False)
        return made


def _keyed(kind: bytes, kwargs: dict):
    key = hashlib.blake2b(kind, digest_size=16)
    key.update(_content(kwargs))
    return key


def _content(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=repr).encode() + b"\x00"


def tools_segment(segments: list[Segment], offered: list[int], bare: list[int]) -> list[Segment]:
    """`segments` with the tokens the tools added to the first message's render named 'tools':
    those of `offered` (the render with the tools) between its common prefix and common suffix with
    `bare` (the render without), cut out of the segment that held them. Unchanged when the template
    renders no tools."""
    cut = tools_cut(offered, bare)
    return [part for segment in segments for part in split_tools(segment, cut)]


def tools_cut(offered: list[int], bare: list[int]) -> tuple[int, int] | None:
    """The token range [start, end) the tools add to `offered` (the first message's render with
    them) against `bare` (without): after their common prefix, before their common suffix; None when
    they add none."""
    head = common_prefix(offered, bare)
    tail = common_prefix(offered[head:][::-1], bare[head:][::-1])
    end = len(offered) - tail
    return (head, end) if end > head else None


def split_tools(segment: Segment, cut: tuple[int, int] | None) -> list[Segment]:
    """`segment`, or its parts before, inside ('tools') and after the range `cut` (`tools_cut`) when
    the range starts inside it."""
    if cut is None or not segment.start <= cut[0] < segment.end:
        return [segment]
    head, end = cut[0], min(cut[1], segment.end)
    parts = (Segment(segment.name, segment.start, head), Segment("tools", head, end),
             Segment(segment.name, end, segment.end))
    return [part for part in parts if part.end > part.start]


class ChatSegments:
    """A chat prompt's segments (`RequestExplainer.segments`), found as they are read: iterating
    renders (or looks up) the message prefixes only as far as the reader goes, and remembers what
    it found, so a remembered prompt's segments cost nothing until a later explanation reads them.
    Iterated under RequestExplainer's lock."""

    def __init__(self, renders: PrefixRenders, messages: list[dict], length: int, kwargs: dict) -> None:
        self._messages, self._length, self._kwargs = messages, length, kwargs
        self._renders = renders
        self._found: list[Segment] = []
        self._lengths: Iterator[int] | None = None
        self._index = self._start = 0
        self._cut: tuple[int, int] | None = None
        self._ended = False

    def __iter__(self) -> Iterator[Segment]:
        read = 0
        while True:
            while read >= len(self._found) and not self._ended:
                self._extend()
            if read >= len(self._found):
                return
            yield self._found[read]
            read += 1

    def _extend(self) -> None:
        """The next message's segment (or, after the last, the generation prompt's) found."""
        if self._lengths is None:
            self._lengths = self._renders.each_length(self._messages, self._kwargs)
            self._cut = tools_cut(*self._renders.tools(self._messages[0], self._kwargs))
        end = next(self._lengths, None)
        if end is None:
            found, self._ended = Segment("generation prompt", self._start, self._length), True
        else:
            end = min(max(end, self._start), self._length)
            role = self._messages[self._index].get("role")
            name = "system" if role in ("system", "developer") else f"message {self._index}"
            found, self._index, self._start = Segment(name, self._start, end), self._index + 1, end
        self._found += split_tools(found, self._cut)
