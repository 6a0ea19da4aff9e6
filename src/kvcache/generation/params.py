"""How a request samples and when it stops: the one `SamplingParams` of `generate` and the engine
(vLLM's field names), checked when it is made; `RequestError` names a field out of range."""

from __future__ import annotations

import math
from dataclasses import dataclass

GREEDY_BELOW = 1e-5  # temperatures this small sample greedily


class RequestError(ValueError):
    """A request refused (nothing queued): which field, what was expected, what was given."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    max_tokens: new tokens at most (>= 1). temperature: 0 is greedy (the default; so is any value
    below GREEDY_BELOW, as in vLLM: dividing logits by it would overflow), else sample from
    softmax(logits / temperature) after top_k and top_p (in that order, as transformers does).
    seed: the request's own generator, < 2**64 (None: the sampler's shared one). stop: strings that end the
    request once its new text contains one (the string is not returned). stop_token_ids: ids that
    end it, besides the model's EOS ids (ignore_eos=True drops those). cache_salt: requests of
    different salts never share cached blocks (vLLM's field: a prefix hit shows in timing, so a
    tenant may opt out of sharing); None shares with every request without one.
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
        if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= 256 and _encodes(salt)):
            raise RequestError(f"cache_salt must be a string of 1 to 256 characters (UTF-8: no lone "
                               f"surrogate), got {salt!r:.80}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def check(self, vocab_size: int) -> None:
        """Raise RequestError unless every stop token id is in [0, vocab_size)."""
        for token in self.stop_token_ids:
            if token >= vocab_size:
                raise RequestError(f"stop_token_ids must lie in [0, {vocab_size}), got {token}")


def _encodes(text: str) -> bool:
    """Whether `text` is valid Unicode for UTF-8 (a lone surrogate is not; the salt is hashed as UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _integer(name: str, value, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise RequestError(f"{name} must be an integer >= {minimum}, got {value!r}")
