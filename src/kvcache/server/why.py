"""The server's side of the prefix-miss explainer (`kvcache.reuse.explain`): a chat request's
segments (system, message k, generation prompt) as token ranges, what the engine's KV pool holds,
and the explanations of recent requests by response id (for `GET /v1/why/{id}`). It reads the
prompt; it never changes what is submitted."""

from __future__ import annotations

import collections
import hashlib
import json
import threading

from kvcache.blocks import salt_root
from kvcache.blocks.allocator import common_prefix
from kvcache.engine import Engine
from kvcache.reuse.explain import CONTEXT_TOKENS, Explanation, PrefixExplainer, Segment

REMEMBERED = 256  # prompts (and explanations by id) kept


class RequestExplainer:
    """Explains each prompt against the ones before it, then remembers it. Only the engine's KV
    pool (memory) is asked whether a block is still held; a block a lower tier still holds is
    loaded by the engine and counted in cached_tokens, not here."""

    def __init__(self, engine, tokenizer, capacity: int = REMEMBERED) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        decode = None if tokenizer is None else tokenizer.decode
        self.explainer = PrefixExplainer(engine.limits.block_size, capacity, decode=decode)
        self._lock = threading.Lock()
        self._by_id: collections.OrderedDict[str, tuple[Explanation, list[int]]] = collections.OrderedDict()
        self._capacity = capacity
        self.renders = PrefixRenders(tokenizer)

    def explain(self, prompt, ids: list[int], cache_salt: str | None,
                template_kwargs: dict | None = None) -> Explanation:
        """The explanation of `ids` (rendered from `prompt` with the chat template's further variables
        `template_kwargs`: the tools offered, chat_template_kwargs) under `cache_salt`; then remembers it."""
        segments = self.segments(prompt, len(ids), template_kwargs)
        root = salt_root(cache_salt)
        held = None  # (replicas: each holds its own pool, not asked here; what was seen counts as held)
        if isinstance(self.engine, Engine):
            allocator = self.engine.pool.cache.allocator
            held = lambda digest: allocator.attachable([digest]) == 1  # noqa: E731
        with self._lock:
            answer = self.explainer.explain(ids, root, segments, held=held)
            self.explainer.record(ids, root, segments)
        return answer

    def segments(self, prompt, length: int, template_kwargs: dict | None = None) -> list[Segment]:
        """Token ranges of a chat prompt's messages (each rendered prefix's length, with the tools and
        template variables the prompt had), the tools the template wrote into the first message, the
        rest the generation prompt; none for a text or token prompt."""
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        if not chat or self.tokenizer is None:
            return []
        kwargs = template_kwargs or {}
        found, start = [], 0
        for index, end in enumerate(self.renders.lengths(prompt, kwargs)):
            end = min(max(end, start), length)
            name = "system" if prompt[index].get("role") in ("system", "developer") else f"message {index}"
            found.append(Segment(name, start, end))
            start = end
        found.append(Segment("generation prompt", start, length))
        return tools_segment(found, *self.renders.tools(prompt[0], kwargs))

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
        key, found = _keyed(b"lengths", kwargs), []
        for index, message in enumerate(messages):
            key.update(_content(message))
            found.append(self._remembered(key.digest(), lambda end=index + 1: len(
                self.tokenizer.apply_chat_template(messages[:end], add_generation_prompt=False, **kwargs))))
        return found

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
    head = common_prefix(offered, bare)
    tail = common_prefix(offered[head:][::-1], bare[head:][::-1])
    end = len(offered) - tail
    if end <= head:
        return segments
    found = []
    for segment in segments:
        if segment.start <= head < segment.end:
            cut = min(end, segment.end)
            parts = (Segment(segment.name, segment.start, head), Segment("tools", head, cut),
                     Segment(segment.name, cut, segment.end))
            found += [part for part in parts if part.end > part.start]
        else:
            found.append(segment)
    return found
