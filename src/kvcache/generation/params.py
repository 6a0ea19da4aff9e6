"""How a request samples and when it stops: the one `SamplingParams` of `generate` and the engine
(vLLM's field names), checked when it is made; `RequestError` names a field out of range."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # temperatures this small sample greedily
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's: a bias lies in [-100, 100]
PENALTY_LIMIT = 2.0  # OpenAI's: presence and frequency penalties lie in [-2, 2]
#: what a request's `speculate` may name: "ngram" (prompt lookup drafts) or "off"
SPECULATE_MODES = ("ngram", "off")


class RequestError(ValueError):
    """A request refused (nothing queued): which field, what was expected, what was given."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    max_tokens: new tokens at most (>= 1). temperature: 0 is greedy (the default; so is any value
    below GREEDY_BELOW, as in vLLM: dividing logits by it would overflow), else sample from
    softmax(logits / temperature) after top_k, top_p and min_p (in that order, as transformers
    does). min_p: in [0, 1]; drop the tokens less likely than min_p times the likeliest one.
    logit_bias: {token id: bias in [-100, 100]} (ids as ints or decimal strings, OpenAI's), added
    to the model's logits; kept as sorted (id, bias) pairs. presence_penalty, frequency_penalty
    (OpenAI's, in [-2, 2]): subtracted from the logit of each token the request has generated so
    far, once (presence) and once per time it was generated (frequency); the prompt does not
    count. repetition_penalty (vLLM's and llama.cpp's, > 0; 1 is off): the logit of every token in
    the prompt or generated so far is divided by it when positive, multiplied when not.
    The bias and penalties apply to the raw logits (bias, then repetition, frequency, presence,
    as vLLM does), before temperature; a greedy request takes the argmax of the adjusted logits.
    seed: the request's own generator, < 2**64 (None: the sampler's shared one). stop: strings that end the
    request once its new text contains one (the string is not returned). stop_token_ids: ids that
    end it, besides the model's EOS ids (ignore_eos=True drops those). cache_salt: requests of
    different salts never share cached blocks (vLLM's field: a prefix hit shows in timing, so a
    tenant may opt out of sharing); None shares with every request without one. structured: a
    `kvcache.generation.structured.StructuredOutput` the output must match (a JSON schema, any
    JSON object, a grammar, a regex): tokens outside it are masked before the bias and penalties.
    logprobs: None, or how many of the likeliest tokens' log-probabilities to give beside each
    chosen token's own (0 to 20; `kvcache.generation.logprobs` says which distribution).
    speculate (the engine's): None follows the engine's default (`Engine(speculate=...)`, off
    unless given); "ngram" drafts by prompt lookup and verifies the drafts in the decode steps
    (the same tokens, `kvcache.engine.speculation`); "off" never drafts, whatever the default.
    Raises RequestError naming the first field out of range.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    cache_salt: str | None = None
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    structured: object | None = None  # a structured.StructuredOutput (checked when it is made)
    logprobs: int | None = None
    speculate: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))  # one string is one stop string
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _integer("max_tokens", self.max_tokens, minimum=1)
        if (
            isinstance(self.temperature, bool)
            or not isinstance(self.temperature, (int, float))
            or not (math.isfinite(self.temperature) and self.temperature >= 0)
        ):
            raise RequestError(
                f"temperature must be a finite number >= 0, got {self.temperature!r}"
            )
        top_p = self.top_p
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None:
            _integer("top_k", self.top_k, minimum=1)
        if self.seed is not None:
            _integer("seed", self.seed, minimum=0)
            if self.seed >= 1 << 64:
                raise RequestError(f"seed must be below 2**64 (a generator's seed), got {self.seed}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise RequestError(f"stop strings must be non-empty strings, got {text!r}")
        for token in self.stop_token_ids:
            _integer("stop_token_ids", token, minimum=0)
        salt = self.cache_salt
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 256
                                     and encodes_as_utf8(salt)):
            raise RequestError(f"cache_salt must be a string of 1 to 256 characters (UTF-8: no lone "
                               f"surrogate), got {salt!r:.80}")
        if self.speculate is not None and self.speculate not in SPECULATE_MODES:
            raise RequestError(f"speculate must be None or one of {SPECULATE_MODES}, got {self.speculate!r}")
        self._check_logit_changes()

    def _check_logit_changes(self) -> None:
        """Check min_p, the penalties and logit_bias (made sorted (id, bias) pairs)."""
        _number("min_p", self.min_p, 0.0, 1.0)
        _number("presence_penalty", self.presence_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _number("frequency_penalty", self.frequency_penalty, -PENALTY_LIMIT, PENALTY_LIMIT)
        _number("repetition_penalty", self.repetition_penalty, 0.0, math.inf)
        if self.repetition_penalty == 0:
            raise RequestError("repetition_penalty must be > 0 (1 is off), got 0")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, minimum=0)
            if self.logprobs > 20:
                raise RequestError(f"logprobs must be at most 20 (OpenAI's bound), got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalizes(self) -> bool:
        """Whether a penalty reads the tokens the request has seen (prompt and output)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the raw logits change before temperature (a bias or a penalty)."""
        return bool(self.logit_bias) or self.penalizes

    def check(self, vocab_size: int) -> None:
        """Raise RequestError unless every stop token id and logit_bias id is in [0, vocab_size)."""
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise RequestError(f"stop_token_ids must lie in [0, {vocab_size}), got {token}")
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise RequestError(f"logit_bias token ids must lie in [0, {vocab_size}), got {token}")


def encodes_as_utf8(text: str) -> bool:
    """Whether `text` can be written as UTF-8 (a lone surrogate, which JSON can carry, cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _integer(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _number(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        bounds = f"> {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise RequestError(f"{name} must be a finite number {bounds}, got {value!r}")
    if not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number, got {value!r}")


def _logit_bias(given) -> tuple[tuple[int, float], ...]:
    """Sorted (token id, bias) pairs of a mapping or pairs; ids as ints or decimal strings."""
    pairs = given.items() if isinstance(given, Mapping) else given
    if isinstance(pairs, (str, bytes)) or not hasattr(pairs, "__iter__"):
        raise RequestError(f"logit_bias must map token ids to biases, got {given!r:.80}")
    biases: dict[int, float] = {}
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            raise RequestError(f"logit_bias must map token ids to biases, got an item {pair!r:.80}")
        key, bias = pair
        decimal = isinstance(key, str) and key.isascii() and key.isdecimal() and len(key) <= 12
        token = int(key) if decimal else key
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < 1 << 40:
            raise RequestError(f"logit_bias keys must be token ids (integers >= 0), got {key!r:.80}")
        _number(f"logit_bias[{key!r}]", bias, -LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT)
        if token in biases:
            raise RequestError(f"logit_bias names token {token} twice")
        biases[token] = float(bias)
    return tuple(sorted(biases.items()))
