"""The server's side of the prefix-miss explainer (`kvcache.reuse.explain`): a chat request's
segments (system, message k, generation prompt) as token ranges, what the engine's KV pool holds,
and the explanations of recent requests by response id (for `GET /v1/why/{id}`). It reads the
prompt; it never changes what is submitted."""

from __future__ import annotations

import collections
import threading

from kvcache.blocks import salt_root
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

    def explain(self, prompt, ids: list[int], cache_salt: str | None,
                tools: list | None = None) -> Explanation:
        """The explanation of `ids` (rendered from `prompt`, with `tools` offered to the chat template)
        under `cache_salt`; then remembers it."""
        segments = self.segments(prompt, len(ids), tools)
        root = salt_root(cache_salt)
        held = None  # (replicas: each holds its own pool, not asked here; what was seen counts as held)
        if isinstance(self.engine, Engine):
            allocator = self.engine.pool.cache.allocator
            held = lambda digest: allocator.attachable([digest]) == 1  # noqa: E731
        with self._lock:
            answer = self.explainer.explain(ids, root, segments, held=held)
            self.explainer.record(ids, root, segments)
        return answer

    def segments(self, prompt, length: int, tools: list | None = None) -> list[Segment]:
        """Token ranges of a chat prompt's messages (each rendered prefix's length, with `tools` as
        the prompt had them), the rest the generation prompt; none for a text or token prompt."""
        chat = isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)
        if not chat or self.tokenizer is None:
            return []
        found, start = [], 0
        for index, message in enumerate(prompt):
            end = len(self.tokenizer.apply_chat_template(prompt[: index + 1], add_generation_prompt=False,
                                                         **({"tools": tools} if tools else {})))
            end = min(max(end, start), length)
            name = "system" if message.get("role") in ("system", "developer") else f"message {index}"
            found.append(Segment(name, start, end))
            start = end
        found.append(Segment("generation prompt", start, length))
        return found

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
