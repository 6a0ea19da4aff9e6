"""A request inside the engine, and the handle its submitter holds: tokens as they are made, then a
finish reason and usage."""

from __future__ import annotations

import asyncio
import queue
import sys
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcache.blocks import salt_root
from kvcache.generation.params import SamplingParams
from kvcache.generation.penalties import SeenTokens
from kvcache.generation.stops import StopRule

FINISH_REASONS = ("stop", "length", "cancelled", "error")


@dataclass
class Usage:
    """Tokens of one request: its prompt, how many of those came from the prefix cache (attached,
    not recomputed) when it was first admitted, and the tokens it made; with speculative
    decoding, the draft tokens its steps verified and how many of those were taken."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class Completion:
    """A finished request: its new tokens, why it stopped (one of FINISH_REASONS), its usage, and
    the error message when it failed."""

    request_id: int
    prompt: list[int]
    tokens: list[int]
    finish_reason: str
    usage: Usage
    error: str | None = None
    time_to_first_token_s: float | None = None
    token_times_s: list[float] = field(default_factory=list, repr=False)  # when each token came
    text: str | None = None  # the reply's text, cut before a stop string (None: no tokenizer)
    kv_drift: object = None  # its `drift_probe.KVDrift` when the drift probe sampled it
    # each new token's `generation.logprobs.TokenLogprobs`, when its params asked (logprobs)
    logprobs: list | None = None


class ReplyReader:
    """A reply read as it comes, asynchronously, from its `updates()`: its token ids (async
    iteration) or its text (`texts()`). What the server reads of a request, on this engine
    (`RequestHandle`) or on a replica (`kvcache.replicas.replica_set.ReplicaHandle`). Both keep
    `logprobs`: each token's `TokenLogprobs` when the request asked, there before its update."""

    def updates(self) -> AsyncIterator[tuple[int | None, str]]:
        """(token id, the text it made final) pairs as they come, then (None, the text left at the
        end) when there is some."""
        raise NotImplementedError

    async def __aiter__(self) -> AsyncIterator[int]:
        """The new token ids, awaited on the running event loop (a server's)."""
        async for token, _ in self.updates():
            if token is not None:
                yield token

    async def texts(self) -> AsyncIterator[str]:
        """The reply's text as it becomes final (whole characters, cut before a stop string), in
        pieces whose join is `Completion.text`."""
        async for _, piece in self.updates():
            if piece:
                yield piece


class RequestHandle(ReplyReader):
    """What `Engine.submit` returns. Iterate it for the new token ids as they are made (or
    `texts()`, asynchronously, for the reply's text as it becomes final); `result()` waits for
    the Completion; `cancel()` ends the request at the next step (its blocks freed), and so
does dropping the last reference to the handle (nobody is left to read what it makes).

    With the engine's background thread running (`Engine.start`) the handle waits for it; without,
    iterating or `result()` runs the engine's steps itself, so one thread can drive many handles.
    """

    def __init__(self, request_id: int, engine) -> None:
        self.request_id = request_id
        self.logprobs: list = []  # each token's TokenLogprobs, when asked, before its event
        self._engine = engine
        self._events: queue.Queue = queue.Queue()
        self._completion: Completion | None = None
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None  # an async reader
        self.cancel_requested = False

    # ---- the engine's side ----------------------------------------------------------------------
    def _put(self, token: int | None, piece: str) -> None:
        """A new token and the text it made final (token None: the text left at the end)."""
        self._events.put((token, piece))
        self._notify()

    def _finish(self, completion: Completion) -> None:
        self._completion = completion
        self._events.put(completion)
        self._notify()

    def _notify(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            loop, event = waiter
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the reader's loop closed: nobody to wake
                pass

    # ---- the submitter's side -------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to end this request (finish reason "cancelled") at its next step."""
        self.cancel_requested = True
        self._engine.wake()

    @property
    def done(self) -> bool:
        return self._completion is not None

    def _next_event(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._events.get_nowait()
            except queue.Empty:
                pass
            if not self._engine.running_in_background:
                if not self._engine.step():
                    raise RuntimeError("the engine has no work left but this request has not finished")
                continue
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"request {self.request_id} did not finish in time")
            try:
                return self._events.get(timeout=0.1 if remaining is None else min(remaining, 0.1))
            except queue.Empty:
                continue

    def __iter__(self) -> Iterator[int]:
        while True:
            event = self._next_event(None)
            if isinstance(event, Completion):
                return
            if event[0] is not None:
                yield event[0]

    async def updates(self) -> AsyncIterator[tuple[int | None, str]]:
        """`ReplyReader.updates`; needs the engine's loop running elsewhere (`Engine.start`,
        `Engine.run`), as async iteration and `texts()` do."""
        if not self._engine.running_in_background:
            raise RuntimeError("async iteration needs the engine's loop running: call engine.start()")
        event = asyncio.Event()
        self._waiter = (asyncio.get_running_loop(), event)
        try:
            while True:
                try:
                    item = self._events.get_nowait()
                except queue.Empty:
                    event.clear()
                    if self._events.empty():  # checked after clear(): a token put meanwhile sets it
                        await event.wait()
                    continue
                if isinstance(item, Completion):
                    return
                yield item
        finally:
            self._waiter = None

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion, once the request finished (tokens not yet read are skipped)."""
        while self._completion is None:
            self._next_event(timeout)
        return self._completion


class Request:
    """The engine's record of one request: its known tokens (prompt, then generated), how many of
    them the cache holds, and how it samples and stops."""

    def __init__(
        self,
        request_id: int,
        prompt: list[int],
        params: SamplingParams,
        stop_rule: StopRule,
        handle: RequestHandle,
        arrival: int,
        grammar=None,
        speculation=None,
    ) -> None:
        self.id = request_id
        self.prompt = prompt
        self.tokens = list(prompt)  # prompt, then every generated token
        self.params = params
        # what its penalties read, counted as it grows (None: it has no penalty)
        self.seen = SeenTokens(self.tokens, len(prompt)) if params.penalizes else None
        self.stop_rule = stop_rule
        self.grammar = grammar  # its `structured.GrammarState` when its output follows a grammar
        self.speculation = speculation  # its `speculation.RowDrafts` when it drafts
        self._handle = weakref.ref(handle)  # a handle its submitter dropped cancels the request
        self.cancel_requested = False
        self.arrival = arrival
        self.cached = 0  # tokens whose keys and values the cache holds
        self.usage = Usage(prompt_tokens=len(prompt))
        self.admitted = False  # once admitted, later admissions are recomputations
        self.first_pass = True  # not preempted yet: prompt tokens served from caches count in usage
        # its own generator only when it gave a seed (the others draw from the runner's)
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.submitted_at = time.perf_counter()
        self.token_times: list[float] = []
        self.finish: tuple[str, str | None] | None = None  # (reason, error) once it stopped
        # (tokens hashed, the prefix hashes of its whole blocks): kept while it waits
        self.digests: tuple[int, list[bytes]] | None = None
        self.root = salt_root(params.cache_salt)  # its blocks' hash chain starts here
        self.tail = ""  # the text its stop rule held back until it ended
        self.drift = None  # a `drift_probe.KVDrift` while (and after) the drift probe runs it
        self.logprobs: list | None = None if params.logprobs is None else []  # TokenLogprobs a token

    def cancel(self) -> None:
        """End this request at the engine's next step (the engine's own cancel: shutting down)."""
        self.cancel_requested = True

    @property
    def cancelled(self) -> bool:
        """Cancelled (by its submitter or the engine), or its handle dropped (nobody can read what
        it makes)."""
        handle = self._handle()
        return self.cancel_requested or handle is None or handle.cancel_requested

    def deliver(self, token: int | None, piece: str) -> None:
        """Hand a new token and the text it made final to the submitter's handle (if it still has
        one); token None: the text left when the request ended."""
        handle = self._handle()
        if handle is not None:
            handle._put(token, piece)

    def finished(self, completion: Completion) -> None:
        """Hand the rest of its text, then the Completion, to the submitter's handle (if it still
        has one)."""
        handle = self._handle()
        if handle is not None:
            if self.tail:
                handle._put(None, self.tail)
            handle._finish(completion)

    def append(self, token: int, now: float, logprobs=None) -> str:
        """Take its next token (chosen at time `now`); the text it made final. Sets `finish` if
        it stopped ("stop": an EOS id, a stop string or its grammar complete; "length"); a stop
        check that raises fails this request only (finish "error")."""
        self.tokens.append(token)
        self.token_times.append(now)
        if self.logprobs is not None:
            self.logprobs.append(logprobs)
            handle = self._handle()
            if handle is not None:
                handle.logprobs.append(logprobs)  # (before the token's event: a reader finds it)
        try:
            piece = self.stop_rule.take(token)
            if self.grammar is not None:
                self.grammar.take(token)
            if self.stop_rule.reason is not None or (self.grammar is not None and self.grammar.done):
                self.finish = ("stop", None)
            elif len(self.generated) >= self.params.max_tokens:
                self.finish = ("length", None)
        except Exception as error:  # noqa: BLE001 (a failing stop check: this request only)
            self.finish = ("error", f"{type(error).__name__}: {error}")
            piece = ""
        return piece

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    def completion(self, reason: str, error: str | None = None) -> Completion:
        """The Completion of this request, ended for `reason`; reads the rest of its text."""
        self.usage.completion_tokens = len(self.generated)
        try:
            self.tail = self.stop_rule.finish()
        except Exception:  # noqa: BLE001 (a tokenizer that fails at the end: no more text)
            self.tail = ""
        reply = self.stop_rule.text
        first = self.token_times[0] - self.submitted_at if self.token_times else None
        return Completion(
            self.id,
            self.prompt,
            self.generated,
            reason,
            self.usage,
            error,
            first,
            [moment - self.submitted_at for moment in self.token_times],
            None if reply is None else reply.text,
            self.drift,
            None if self.logprobs is None else list(self.logprobs),
        )


def notify_all(hook: Callable[[Completion], None] | None, completions: list[Completion]) -> None:
    """Call `hook` with each completion; one that raises is reported on stderr and the others are
    still called. A SystemExit or KeyboardInterrupt from it is raised again once all were called."""
    if hook is None:
        return
    stopping: BaseException | None = None
    for completion in completions:
        try:
            hook(completion)
        except Exception as error:  # noqa: BLE001 (a caller's hook: reported, the engine goes on)
            print(f"kvcache engine: on_finish raised {type(error).__name__}: {error} "
                  f"(request {completion.request_id}); the engine goes on", file=sys.stderr)
        except BaseException as error:  # noqa: BLE001 (raised again below)
            stopping = stopping or error
    if stopping is not None:
        raise stopping
