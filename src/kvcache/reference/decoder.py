"""A tiny multi-layer, multi-head decoder by hand, greedy decoding with and without a KV cache.

Token ids -> embedding row (a lookup, no multiplication) -> L layers, each
    q, k, v = Wq x, Wk x, Wv x                           3·d²
    per head h (width d_h = d / H): attend(q_h, K_h, V_h) over c positions   2·c·d over all heads
    x = x + Wo · concat(heads)                          d²   (the residual add is not a mul)
-> logits = W_out x for the last position only          V·d
There is no norm and no MLP: what is counted is exactly the list above. Without a cache, every
step runs all c positions of the context through every layer (a scratch cache lives for one
forward and is thrown away); with a cache, the prompt is run once (prefill) and each later step
runs one position. Closed forms: `formulas.decoder_nocache_total` / `decoder_cached_total`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.reference.linalg import attend, matvec, project
from kvcache.reference.randoms import random_matrix, random_vector
from kvcache.reference.single_head import KVCache


@dataclass(frozen=True)
class TinyDecoderConfig:
    """Sizes of the tiny decoder: vocabulary, width d, heads H (d % H == 0), layers L."""

    vocab_size: int = 16
    d_model: int = 8
    n_heads: int = 2
    n_layers: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyDecoderConfig: {name} must be ≥ 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"TinyDecoderConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


@dataclass
class DecodeResult:
    """New token ids, and the logits (length vocab_size) from which each was chosen."""

    tokens: list[int]
    logits: list[list[float]]


class TinyDecoder:
    """Seeded random weights; `generate(prompt, n, use_cache=...)` decodes greedily."""

    def __init__(self, config: TinyDecoderConfig | None = None, seed: int = 0) -> None:
        self.config = config or TinyDecoderConfig()
        c = self.config
        rng = random.Random(seed)
        self.embedding = [random_vector(rng, c.d_model) for _ in range(c.vocab_size)]
        self.layers = [
            {name: random_matrix(rng, c.d_model, c.d_model) for name in ("Wq", "Wk", "Wv", "Wo")}
            for _ in range(c.n_layers)
        ]
        self.W_out = random_matrix(rng, c.vocab_size, c.d_model)

    def _layer(self, index: int, x: list[float], cache: KVCache) -> list[float]:
        """Run one position through layer `index`, appending its k, v to that layer's cache."""
        weights = self.layers[index]
        q, k, v = project(x, weights["Wq"], weights["Wk"], weights["Wv"])
        cache.append(k, v)
        dh = self.config.head_dim
        heads: list[float] = []
        for h in range(self.config.n_heads):
            cols = slice(h * dh, (h + 1) * dh)
            heads += attend(q[cols], [key[cols] for key in cache.keys],
                            [value[cols] for value in cache.values])
        out = matvec(weights["Wo"], heads)
        return [a + b for a, b in zip(x, out)]

    def _run(self, token_ids: Sequence[int], caches: list[KVCache]) -> list[float]:
        """Run positions through all layers with the given per-layer caches; logits of the last."""
        if not token_ids:
            raise ValueError("TinyDecoder: no tokens to run")
        for token in token_ids:
            if not 0 <= token < self.config.vocab_size:
                raise ValueError(
                    f"TinyDecoder: token id {token} outside the vocabulary [0, {self.config.vocab_size})"
                )
            x = list(self.embedding[token])
            for index in range(self.config.n_layers):
                x = self._layer(index, x, caches[index])
        return matvec(self.W_out, x)

    def new_caches(self) -> list[KVCache]:
        """One empty KVCache per layer."""
        return [KVCache() for _ in range(self.config.n_layers)]

    def generate(self, prompt: Sequence[int], max_new_tokens: int, use_cache: bool = True) -> DecodeResult:
        """Greedy decoding of `max_new_tokens` tokens after `prompt` (token ids)."""
        if max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be ≥ 0, got {max_new_tokens}")
        context = list(prompt)
        result = DecodeResult(tokens=[], logits=[])
        caches = self.new_caches()
        pending = context  # positions the next forward must run
        for _ in range(max_new_tokens):
            if use_cache:
                logits = self._run(pending, caches)
            else:
                logits = self._run(context, self.new_caches())  # recompute the whole context
            token = max(range(len(logits)), key=logits.__getitem__)
            result.tokens.append(token)
            result.logits.append(logits)
            context.append(token)
            pending = [token]
        return result
