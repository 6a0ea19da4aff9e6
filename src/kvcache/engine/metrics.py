"""What the engine counts: requests, tokens, preemptions, and the time its forwards take; an
observer of the engine's steps (`observers`), on its one list."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvcache.engine.observers import StepObserver


@dataclass
class EngineMetrics(StepObserver):
    """Counters since the engine was made or last restarted (gauges of the pool: `Engine.stats`)."""

    submitted: int = 0
    steps: int = 0
    preemptions: int = 0
    prompt_tokens: int = 0  # of requests admitted
    cached_prompt_tokens: int = 0  # of those, attached from the prefix cache
    generated_tokens: int = 0
    drafted_tokens: int = 0  # draft tokens verified for the requests that ended (speculation)
    accepted_tokens: int = 0  # of those, the ones taken
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

    def applied(self, work, running: list) -> None:
        """Prompt tokens served without a forward in a step (attached from the pool:
        `work.attached`, loaded from the store: `work.loaded`, by request id) in each request's
        usage and the counters, while a request is on its first pass: a recomputation after a
        preemption is not counted again."""
        for request in running:
            if request.id in work.attached and not request.admitted:
                request.admitted = True
                self.prompt_tokens += len(request.prompt)
                request.usage.cached_tokens += work.attached[request.id]
                self.cached_prompt_tokens += work.attached[request.id]
            if request.first_pass and request.id in work.loaded:
                request.usage.cached_tokens += work.loaded[request.id]
                self.cached_prompt_tokens += work.loaded[request.id]
                self.unpriced_tokens += work.loaded[request.id]
        self._price_loaded()

    def ran(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """Count a step's decode rows and prefill tokens, and add its seconds to the decode time
        when it had decode rows and to the prefill time when it had prompt tokens (a step that
        mixes both counts in both); a step of prompt chunks alone, or of one decode row alone,
        also measures `prefill_token_seconds`."""
        if prompt_tokens:
            self.prefill_seconds += seconds
            self.prefill_tokens += prompt_tokens
        if decode_rows:
            self.decode_seconds += seconds
            self.decode_tokens += decode_rows
        if prompt_tokens and not decode_rows:
            self.prefill_only_steps += 1
            self.prefill_only_tokens += prompt_tokens
            self.prefill_only_seconds += seconds
        elif decode_rows == 1 and not prompt_tokens:
            self.one_row_steps += 1
            self.one_row_seconds += seconds
        self._price_loaded()

    def delivered(self, tokens: int) -> None:
        self.generated_tokens += tokens

    def preempted(self, requests: list) -> None:
        self.preemptions += len(requests)

    def stepped(self, cache) -> None:
        self.steps += 1

    def completed(self, completions: list) -> None:
        for completion in completions:
            self.finished[completion.finish_reason] = self.finished.get(completion.finish_reason, 0) + 1
            self.drafted_tokens += completion.usage.drafted_tokens
            self.accepted_tokens += completion.usage.accepted_tokens

    def restarted(self) -> None:
        """Every counter back to zero (in place: the engine's observer list holds this object)."""
        for counter in dataclasses.fields(self):
            default = counter.default_factory() if counter.default is dataclasses.MISSING else counter.default
            setattr(self, counter.name, default)

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
