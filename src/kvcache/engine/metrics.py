"""What the engine counts: requests, tokens, preemptions, and the time its forwards take."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class EngineMetrics:
    """Counters since the engine was made (gauges of the pool: `Engine.stats`)."""

    submitted: int = 0
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # of requests admitted
    cached_prompt_tokens: int = 0  # of those, attached from the prefix cache
    generated_tokens: int = 0
    prefill_tokens: int = 0  # run through prefill forwards (recomputations included)
    decode_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    prefill_seconds_saved: float = 0.0  # their prefill, at the measured seconds per token then
    unpriced_tokens: int = 0  # loaded before any prefill was measured: priced at the first one

    def count_cached(self, admitted: list, running: list, attached: dict, loaded: dict) -> None:
        """Prompt tokens served without a forward in a step (attached from the pool: `attached`,
        loaded from the store: `loaded`, by request id) in each request's usage and the counters,
        while a request is on its first pass: a recomputation after a preemption is not counted
        again."""
        for request in admitted:
            if not request.admitted:
                request.admitted = True
                self.prompt_tokens += len(request.prompt)
                request.usage.cached_tokens += attached[request.id]
                self.cached_prompt_tokens += attached[request.id]
        for request in running:
            if request.first_pass and request.id in loaded:
                request.usage.cached_tokens += loaded[request.id]
                self.cached_prompt_tokens += loaded[request.id]
                self.unpriced_tokens += loaded[request.id]
        if self.unpriced_tokens and self.prefill_tokens:  # at the prefill seconds per token so far
            self.prefill_seconds_saved += self.unpriced_tokens * self.prefill_seconds / self.prefill_tokens
            self.unpriced_tokens = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @contextmanager
    def timing(self, decode_tokens: int, prefill_tokens: int):
        """Count a step's decode rows and prefill tokens, and add its seconds to the decode time
        when it had decode rows and to the prefill time when it had prompt tokens (a step that
        mixes both counts in both)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            if prefill_tokens:
                self.prefill_seconds += elapsed
                self.prefill_tokens += prefill_tokens
            if decode_tokens:
                self.decode_seconds += elapsed
                self.decode_tokens += decode_tokens

    @property
    def prefix_hit_rate(self) -> float:
        """Share of admitted prompt tokens served from the prefix cache."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0
