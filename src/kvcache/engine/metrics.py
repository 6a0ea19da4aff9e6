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
    prefill_seconds_saved: float = 0.0  # their prefill, each token at `prefill_token_seconds`
    unpriced_tokens: int = 0  # loaded before a price was measured: priced at the first one
    # steps of prompt chunks alone (no decode row) and steps of one decode row alone: what
    # `prefill_token_seconds` is measured from
    prefill_only_steps: int = 0
    prefill_only_tokens: int = 0
    prefill_only_seconds: float = 0.0
    one_row_steps: int = 0
    one_row_seconds: float = 0.0

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
        self._price_loaded()

    @property
    def prefill_token_seconds(self) -> float | None:
        """What one more prompt token adds to a step, measured: the seconds of the steps of prompt
        chunks alone past what one token's step takes (a step of one decode row), spread over
        their tokens past one a step; at most their mean seconds per token. None until both were
        measured. Not the mean of every prefill step: a step's fixed cost is paid whether a hit
        skips tokens or not (the prompt's remainder still runs), a step that also decodes counts
        its decode rows' time, and a short prefill left after a hit is mostly that fixed cost."""
        extra_tokens = self.prefill_only_tokens - self.prefill_only_steps
        if not self.one_row_steps or extra_tokens <= 0:
            return None
        one_token = self.one_row_seconds / self.one_row_steps
        marginal = (self.prefill_only_seconds - self.prefill_only_steps * one_token) / extra_tokens
        return min(max(marginal, 0.0), self.prefill_only_seconds / self.prefill_only_tokens)

    def _price_loaded(self) -> None:
        """Add the loaded tokens not priced yet to `prefill_seconds_saved`, each once, at
        `prefill_token_seconds` (none measured yet: they wait for it)."""
        price = self.prefill_token_seconds
        if self.unpriced_tokens and price is not None:
            self.prefill_seconds_saved += self.unpriced_tokens * price
            self.unpriced_tokens = 0

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    @contextmanager
    def timing(self, decode_tokens: int, prefill_tokens: int):
        """Count a step's decode rows and prefill tokens, and add its seconds to the decode time
        when it had decode rows and to the prefill time when it had prompt tokens (a step that
        mixes both counts in both); a step of prompt chunks alone, or of one decode row alone,
        also measures `prefill_token_seconds`."""
        started = self.now()
        try:
            yield
        finally:
            elapsed = self.now() - started
            if prefill_tokens:
                self.prefill_seconds += elapsed
                self.prefill_tokens += prefill_tokens
            if decode_tokens:
                self.decode_seconds += elapsed
                self.decode_tokens += decode_tokens
            if prefill_tokens and not decode_tokens:
                self.prefill_only_steps += 1
                self.prefill_only_tokens += prefill_tokens
                self.prefill_only_seconds += elapsed
            elif decode_tokens == 1 and not prefill_tokens:
                self.one_row_steps += 1
                self.one_row_seconds += elapsed
            self._price_loaded()

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
