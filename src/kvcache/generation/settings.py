"""How one `generate` call runs: lengths, sampling, stopping and prefill chunks, in one place."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.generation.params import SamplingParams

#: the drafting methods of `speculate` (`kvcache.generation.speculative`)
METHODS = ("ngram",)


@dataclass(frozen=True)
class GenerationSettings:
    """The settings of `generate` / `stream_generate`, which take them as keywords.

    max_new_tokens: tokens to generate per row (>= 1).
    do_sample, temperature, top_k, top_p, min_p: greedy unless do_sample (then temperature > 0).
    repetition_penalty: > 0, 1 is off; applies greedy too (`SamplingParams` says how).
    eos_token_id: None = the model config's (and tokenizer's) EOS ids; () = never stop early.
    pad_token_id: the token of a row after it stopped (None: the first EOS id, else the
        tokenizer's pad token, else 0).
    stop_strings: stop a row once its new text contains one (needs a tokenizer).
    prefill_chunk_size: run the prompt through the model this many tokens at a time.
    structured: a `structured.StructuredOutput` every row's output must match (needs a tokenizer);
        a row whose grammar is complete stops ("grammar").
    speculate: None, or "ngram": decode steps verify prompt-lookup drafts (`speculative`); the
        tokens are the same as without, sampled ones too (one row, a paged cache, a backend whose
        steps are chunk-invariant).
    draft_tokens: the most tokens one draft holds (None: `speculative.DRAFT_TOKENS`).
    """

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    eos_token_id: int | Sequence[int] | None = None
    pad_token_id: int | None = None
    stop_strings: Sequence[str] | None = None
    prefill_chunk_size: int | None = None
    structured: object | None = None
    speculate: str | None = None
    draft_tokens: int | None = None

    def __post_init__(self) -> None:
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens < 1
        ):
            raise ValueError(f"max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1 or None, got {self.prefill_chunk_size}")
        if self.do_sample and (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, int | float)
            or not 0 < self.temperature < math.inf
        ):  # NaN fails every comparison, so it lands here too
            raise ValueError(
                f"temperature must be > 0 and finite, got {self.temperature!r}; use do_sample=False for "
                f"greedy"
            )
        if self.speculate is not None and self.speculate not in METHODS:
            raise ValueError(f"speculate must be None or one of {METHODS}, got {self.speculate!r}")
        drafts = self.draft_tokens
        if drafts is not None and (isinstance(drafts, bool) or not isinstance(drafts, int) or drafts < 1):
            raise ValueError(f"draft_tokens must be an int >= 1 or None, got {self.draft_tokens!r}")
        if self.draft_tokens is not None and self.speculate is None:
            raise ValueError("draft_tokens sets the length of speculate's drafts: give speculate='ngram' too")
        self.sampling  # noqa: B018 (validates top_k, top_p, min_p, repetition_penalty)

    @property
    def sampling(self) -> SamplingParams:
        """How to pick each token (greedy: temperature 0), as the engine's requests say it."""
        return SamplingParams(
            max_tokens=self.max_new_tokens,
            temperature=float(self.temperature) if self.do_sample else 0.0,
            top_k=self.top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            min_p=0.0 if self.min_p is None else self.min_p,
            repetition_penalty=self.repetition_penalty,
            structured=self.structured,
        )
