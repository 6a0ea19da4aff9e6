"""Closed-form multiplication counts, next to the code they describe; tests check them against
the counter. d is the model width, t or n a context length.
"""

from __future__ import annotations


def single_head_nocache_step(t: int, d: int) -> int:
    """Step t without a cache: project all t positions (3·t·d²), attend over t (2·t·d)."""
    return 3 * t * d * d + 2 * t * d


def single_head_cached_step(t: int, d: int) -> int:
    """Step t with a cache: project one position (3·d²), attend over t (2·t·d)."""
    return 3 * d * d + 2 * t * d


def single_head_nocache_total(n: int, d: int) -> int:
    """Σ_{t=1..n} (3·t·d² + 2·t·d) = (3d² + 2d)·n(n+1)/2."""
    return (3 * d * d + 2 * d) * n * (n + 1) // 2


def single_head_cached_total(n: int, d: int) -> int:
    """Σ_{t=1..n} (3·d² + 2·t·d) = 3d²·n + d·n(n+1)."""
    return 3 * d * d * n + d * n * (n + 1)


def decoder_forward(positions: int, past: int, d: int, n_layers: int, vocab_size: int) -> int:
    """One forward of the tiny decoder running `positions` new positions after `past` cached ones,
    with logits for the last position: per layer and position i (attending over past+i keys)
    4·d² (q, k, v, o projections) + 2·(past+i)·d (scores and weighted values); then V·d.
    """
    attended = sum(past + i for i in range(1, positions + 1))
    return n_layers * (4 * d * d * positions + 2 * d * attended) + vocab_size * d


def decoder_nocache_total(prompt_len: int, new_tokens: int, d: int, n_layers: int,
                          vocab_size: int) -> int:
    """Greedy decoding without a cache: step s runs all prompt_len + s positions from scratch."""
    return sum(decoder_forward(prompt_len + s, 0, d, n_layers, vocab_size)
               for s in range(new_tokens))


def decoder_cached_total(prompt_len: int, new_tokens: int, d: int, n_layers: int,
                         vocab_size: int) -> int:
    """Greedy decoding with a cache: prefill the prompt once, then one position per step."""
    if new_tokens == 0:
        return 0
    prefill = decoder_forward(prompt_len, 0, d, n_layers, vocab_size)
    return prefill + sum(decoder_forward(1, prompt_len + s - 1, d, n_layers, vocab_size)
                         for s in range(1, new_tokens))
