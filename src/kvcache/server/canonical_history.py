"""An opt-in repair of prefix-cache misses (`kvcache serve --canonical-history`, off by default): the
first form the server rendered of each chat message (after the same history) and the first order
of each set of tools are remembered under a normalised key: whitespace removed and letter case
folded in every text and role, what the explainer's `normalisation` cause names, and the tools as
a set, what `tools_reordered` names. A later request whose message differs from a remembered one
only that way, or that offers the same tools in another order, is rendered in the remembered form,
so a client's cosmetic changes still match the prefix cache.

The first request that renders a form is never changed, nor is a history sent back as the server
first rendered it: such a request renders the same tokens with the repair on or off."""

from __future__ import annotations

import collections
import hashlib
import json
import threading

REMEMBERED = 4096  # message forms (and tool orders) kept


class CanonicalHistory:
    """The first rendered form of the last `capacity` messages and tool sets (the oldest forgotten
    first). A message is keyed by its normalised self after its normalised history, so a message
    repeated in another conversation keeps that conversation's own form."""

    def __init__(self, capacity: int = REMEMBERED) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (message forms remembered), got {capacity}")
        self.capacity = capacity
        self._forms: collections.OrderedDict[bytes, object] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._forms)

    def messages(self, messages: list[dict]) -> list[dict]:
        """`messages` with each one that differs from a remembered form (after the same normalised
        history) only in whitespace or letter case given that form; new forms remembered. The same
        list when none changed."""
        key, found = hashlib.blake2b(b"messages", digest_size=16), None
        for index, message in enumerate(messages):
            key.update(_normalised(message))
            form = self._first(key.digest(), message)
            if form != message:
                found = found or list(messages)
                found[index] = form
        return messages if found is None else found

    def tools(self, tools: tuple) -> tuple:
        """`tools` in the order the server first rendered the same set in (remembered when new)."""
        key = hashlib.blake2b(b"tools", digest_size=16)
        for part in sorted(_exact(tool) for tool in tools):
            key.update(part)
        return self._first(key.digest(), tools)

    def _first(self, key: bytes, form):
        with self._lock:
            if key in self._forms:
                self._forms.move_to_end(key)
                return self._forms[key]
            self._forms[key] = form
            while len(self._forms) > self.capacity:
                self._forms.popitem(last=False)
        return form


def _squeezed(value):
    """`value` with every text's whitespace removed and its letter case folded, at any depth."""
    if isinstance(value, str):
        return "".join(value.split()).casefold()
    if isinstance(value, dict):
        return {_squeezed(name): _squeezed(item) for name, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_squeezed(item) for item in value]
    return value


def _normalised(message) -> bytes:
    return json.dumps(_squeezed(message), sort_keys=True, default=repr).encode() + b"\x00"


def _exact(value) -> bytes:
    return json.dumps(value, sort_keys=True, default=repr).encode() + b"\x00"
