"""Choosing the next token from logits: pure functions of (logits, settings, generator).

Nothing here keeps state or touches a global seed: sampling draws from the `torch.Generator`
it is given, so the same generator state gives the same tokens. Filters follow the order
Hugging Face applies them: temperature, then top-k, then top-p.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcache.backends.threads import torch_threads


@dataclass(frozen=True)
class SamplingSettings:
    """How to pick a token. do_sample=False is greedy (argmax) and ignores the rest."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not (
            0 < temperature < math.inf
        ):  # NaN fails every comparison, so it lands here too
            raise ValueError(
                f"temperature must be > 0 and finite, got {temperature!r}; use do_sample=False for "
                f"greedy"
            )
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 or None, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p}")


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """(B, vocab) -> (B,) the highest-scoring token of each row."""
    return logits.argmax(dim=-1)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature (< 1 sharpens, > 1 flattens)."""
    return logits if temperature == 1.0 else logits / temperature


def top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep each row's top_k scores; the rest become -inf (ties at the k-th score are kept)."""
    top_k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of highest-probability tokens whose mass reaches top_p (>= 1 token)."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, vocab)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
    drop_sorted = mass_before >= top_p  # the first token always has mass_before 0
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, vocab) -> (B,) one token per row drawn from softmax(logits)."""
    probs = logits.float().softmax(dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)


class NonFiniteLogitsError(ValueError):
    """The model's logits hold NaN or inf: no token can be chosen from them (argmax of NaN is
    token 0, a stream of it looks like an answer)."""


def choose_next(
    logits: torch.Tensor,
    settings: SamplingSettings,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(B, vocab) last-position logits -> (B,) next tokens under `settings`. Raises
    `NonFiniteLogitsError` when a row holds NaN or inf. Runs on one torch thread: the work is a
    few passes over B × vocab floats, and right after the numpy step a second torch thread would
    wait for the core OpenBLAS's worker still spins on."""
    with torch_threads(1):
        return _choose_next(logits, settings, generator)


def _choose_next(logits: torch.Tensor, settings: SamplingSettings, generator) -> torch.Tensor:
    finite = torch.isfinite(logits).all(dim=-1)  # (B,)
    if not bool(finite.all()):
        rows = (~finite).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"the model's logits are not finite (NaN or inf) in batch rows {rows}: its weights or "
            f"inputs are broken (a float16 overflow, a corrupt checkpoint?); no token is chosen"
        )
    if not settings.do_sample:
        return greedy(logits)
    logits = apply_temperature(logits.float(), settings.temperature)
    if settings.top_k is not None:
        logits = top_k_filter(logits, settings.top_k)
    if settings.top_p is not None:
        logits = top_p_filter(logits, settings.top_p)
    return sample(logits, generator)
