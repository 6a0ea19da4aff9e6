"""Agent sessions and their advisory KV hints, named as vLLM's session-hint RFCs name them
(vllm#51428: Pin, Retain, Demote, Prefetch; vllm#52113: a session id, a TTL, release).

A request may carry `KVHints`: its session's id and what to do with the blocks of its turn once
it finishes (its prompt and reply, the whole blocks the pool holds):
- pin (ttl_s): kept in the pool, evicted only after every unpinned block, until ttl_s after the
  turn ended; the pin then expires (`Sessions.expire`, at the end of every step, by the clock
  given: one due while the engine is idle ends at the end of its next step);
- retain (priority): above 0, kept as a pin is while the session is live (heard from within
  `idle_s`); 0 leaves them to the pool's LRU. Two levels for now: any priority above 0 is one;
- demote (destination "disk" or "redis", a tier the engine has): evicted from the pool before
  any other unused block, since the tier holds them (kvcache writes every whole block below the
  pool as it is made); a resume reads them back from the tier at submit, before it is scheduled;
- prefetch: what every request gets: its prompt's blocks the pool lacks are read from the tiers
  at submit and loaded before its first step (`kvcache.tiers.connector`); the hint asks nothing
  more of a request;
- release: the session ends with this turn: its pins end, nothing is kept for it.
A turn's hints replace the session's earlier ones. Hints only move unused blocks between the
pool's eviction classes; they never change what a step computes, so every answer is the same
with them, without them, or with other ones.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache.engine.observers import StepObserver
from kvcache.generation.params import RequestError

HINTS = ("session_id", "pin", "retain", "demote", "prefetch", "release")
DESTINATIONS = ("disk", "redis")
SESSION_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
MAX_TTL_S = 86_400.0  # a pin's time to live at most (a day)
MAX_PRIORITY = 100
IDLE_S = 600.0  # a session not heard from for this long is forgotten (its pins end)
MAX_SESSIONS = 1024  # live sessions kept at most (the least recently heard from forgotten first)


@dataclass(frozen=True)
class KVHints:
    """One request's session and hints (see the module docstring)."""

    session_id: str
    pin_ttl_s: float | None = None
    retain_priority: int = 0
    demote: str | None = None
    prefetch: bool = False
    release: bool = False

    @property
    def keeps(self) -> bool:
        """Whether the turn's blocks are pinned (pin, or retain above 0)."""
        return self.pin_ttl_s is not None or self.retain_priority > 0


def read_kv_hints(hints: object, session_header: str | None = None) -> KVHints | None:
    """The `KVHints` of a request body's `kv_hints` object and its x-session-id header (either may
    name the session; both must agree); None when neither is given. RequestError naming the field
    (kv_hints.pin.ttl_s, …) of anything else."""
    if hints is None and session_header is None:
        return None
    if hints is None:
        hints = {}
    if not isinstance(hints, dict):
        raise RequestError(f"kv_hints must be an object, got {type(hints).__name__}")
    unknown = [key for key in hints if key not in HINTS]
    if unknown:
        raise RequestError(f"kv_hints.{unknown[0]} is not a hint; the hints are {', '.join(HINTS)}")
    session = _session_id(hints.get("session_id"), session_header)
    pin = _member(hints, "pin", "ttl_s")
    ttl = None if pin is None else _number("kv_hints.pin.ttl_s", pin, 0.0, MAX_TTL_S)
    retain = _member(hints, "retain", "priority")
    priority = 0 if retain is None else _priority(retain)
    demote = _member(hints, "demote", "destination")
    if demote is not None and demote not in DESTINATIONS:
        raise RequestError(f"kv_hints.demote.destination must be one of {', '.join(DESTINATIONS)}, "
                           f"got {demote!r}")
    prefetch, release = (_flag(hints, name) for name in ("prefetch", "release"))
    read = KVHints(session, ttl, priority, demote, prefetch, release)
    if demote is not None and read.keeps:
        raise RequestError("kv_hints.demote cannot come with kv_hints.pin or kv_hints.retain (above 0): "
                           "a turn's blocks are either kept in memory or let go to a tier")
    if release and (read.keeps or demote is not None):
        raise RequestError("kv_hints.release ends the session: it cannot come with pin, retain or demote")
    return read


def _session_id(body: object, header: str | None) -> str:
    if body is not None and (not isinstance(body, str) or not SESSION_ID.match(body)):
        raise RequestError(f"kv_hints.session_id must be 1 to 128 characters of letters, digits and "
                           f"._:@/+=-, got {body!r}")
    if header is not None and not SESSION_ID.match(header):
        raise RequestError(f"the x-session-id header must be 1 to 128 characters of letters, digits and "
                           f"._:@/+=-, got {header!r}")
    if body is not None and header is not None and body != header:
        raise RequestError(f"kv_hints.session_id ({body!r}) and the x-session-id header ({header!r}) "
                           "name different sessions")
    session = body if body is not None else header
    if session is None:
        raise RequestError("kv_hints needs a session: kv_hints.session_id or the x-session-id header")
    return session


def _member(hints: dict, name: str, key: str):
    """hints[name][key], or None when `name` is absent; RequestError for another shape."""
    value = hints.get(name)
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {key}:
        raise RequestError(f"kv_hints.{name} must be an object {{\"{key}\": …}}, got {value!r}")
    return value[key]


def _number(name: str, value: object, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not low < value <= high:
        raise RequestError(f"{name} must be a number of seconds above {low:g} and at most {high:g}, "
                           f"got {value!r}")
    return float(value)


def _priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_PRIORITY:
        raise RequestError(f"kv_hints.retain.priority must be an integer from 0 to {MAX_PRIORITY}, "
                           f"got {value!r}")
    return value


def _flag(hints: dict, name: str) -> bool:
    value = hints.get(name, False)
    if not isinstance(value, bool):
        raise RequestError(f"kv_hints.{name} must be true or false, got {value!r}")
    return value


@dataclass
class Session:
    """A live session: when it was last heard from, the blocks it pins and until when."""

    heard: float  # when its last turn ended
    pinned: list[bytes] = field(default_factory=list)  # digests it holds a pin of (none: none)
    until: float = 0.0  # when that pin expires


class Sessions(StepObserver):
    """The engine's live sessions over its pool (see the module docstring). `clock` (seconds)
    times pins and idleness; tests pass their own."""

    def __init__(self, pool, clock: Callable[[], float] = time.monotonic, idle_s: float = IDLE_S) -> None:
        self.pool, self.clock, self.idle_s = pool, clock, idle_s
        self.live: OrderedDict[tuple[bytes, str], Session] = OrderedDict()  # least recently heard first
        self._hinted: dict[int, tuple[KVHints, bytes]] = {}  # request id -> its hints, its root
        self._lock = threading.Lock()  # _hinted (submitting threads and the engine's)

    def tiers(self) -> tuple[str, ...]:
        """The kinds of the tiers below the pool ("disk", "redis")."""
        store = self.pool.connector.store
        if store is None:
            return ()
        return tuple(tier.kind for tier in getattr(store, "tiers", [store]))

    def submitted(self, request_id: int, hints: KVHints, root: bytes) -> None:
        """A request with `hints` was queued (RequestError, before it is, for a demotion to a tier
        the engine lacks)."""
        if hints.demote is not None and hints.demote not in self.tiers():
            have = ", ".join(self.tiers()) or "none"
            raise RequestError(f"kv_hints.demote.destination {hints.demote!r}: this server has no such tier "
                               f"(its tiers: {have}; kvcache serve --kv-disk DIR, --kv-store URL)")
        with self._lock:
            self._hinted[request_id] = (hints, root)

    def completed(self, completions: list) -> None:
        """Each hinted request's turn ended: its session's blocks kept, demoted or let go."""
        for completion in completions:
            with self._lock:
                entry = self._hinted.pop(completion.request_id, None)
            if entry is not None:
                self._turn_ended(*entry, [*completion.prompt, *completion.tokens])

    def _turn_ended(self, hints: KVHints, root: bytes, tokens: list[int]) -> None:
        key, now = (root, hints.session_id), self.clock()
        earlier = self.live.pop(key, None)
        if earlier is not None:
            self._unpin(earlier)
        if hints.release:
            return
        session = self.live[key] = Session(now)
        digests = self.pool.cache.prefix_digests(tokens, root)  # (the whole blocks the pool holds)
        if hints.keeps:
            for allocator in self.pool.cache.allocators:
                allocator.pin(digests)
            session.pinned = digests
            session.until = now + (hints.pin_ttl_s if hints.pin_ttl_s is not None else self.idle_s)
        elif hints.demote is not None:
            for allocator in self.pool.cache.allocators:
                allocator.demote(digests)
        while len(self.live) > MAX_SESSIONS:
            self._unpin(self.live.popitem(last=False)[1])

    def _unpin(self, session: Session) -> None:
        if session.pinned:
            for allocator in self.pool.cache.allocators:
                allocator.unpin(session.pinned)
            session.pinned = []

    def expire(self) -> None:
        """Pins whose time passed end; sessions idle past `idle_s` are forgotten."""
        now = self.clock()
        for key, session in list(self.live.items()):
            if session.pinned and now >= session.until:
                self._unpin(session)
            if now - session.heard >= self.idle_s:
                self._unpin(session)
                del self.live[key]

    def step_ended(self) -> None:
        """Every step: `expire`."""
        self.expire()
