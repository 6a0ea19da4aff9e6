"""A backend's steps against the model's own forward, as the tests of every backend drive them:
a prompt, then tokens decoded one by one, on a paged cache through the backend (`PagedSteps`, the
road `generate` takes) or on any other cache through the model's forward (the reference road)."""

from __future__ import annotations

import torch

from kvcache.backends.torch_step import last_logits
from kvcache.cache import make_cache
from kvcache.generation.paged_steps import PagedSteps


def paged_logits(model, backend, prompt, tokens: torch.Tensor, block_size: int = 16,
                 chunk_size: int | None = None, keep: list | None = None) -> list[torch.Tensor]:
    """The (B, vocab) logits after the prompt (B, T), or B lists of ids of their own lengths, and
    after each of tokens (B, n) decoded one by one, on a fresh paged cache, every forward a step
    of `backend`. keep: given a list, the cache is appended to it."""
    prompts = prompt.tolist() if isinstance(prompt, torch.Tensor) else [list(row) for row in prompt]
    longest = max(map(len, prompts))
    cache = make_cache("paged", config=model.config, dtype=model.dtype, max_batch_size=len(prompts),
                       max_cache_len=longest + tokens.shape[1], block_size=block_size)
    if keep is not None:
        keep.append(cache)
    steps = PagedSteps(model, backend, cache, len(prompts))
    with torch.inference_mode():
        out = [steps.prefill(prompts, chunk_size)]
        out += [steps.decode(tokens[:, i]) for i in range(tokens.shape[1])]
    return out


def forward_logits(model, prompt: torch.Tensor, tokens: torch.Tensor, kind: str = "dynamic",
                   **cache_options) -> list[torch.Tensor]:
    """`paged_logits` on the model's own forward through a cache of `kind`."""
    cache = make_cache(kind, config=model.config, dtype=model.dtype, **cache_options)
    with torch.inference_mode():
        out = [last_logits(model, prompt, None, cache)]
        out += [last_logits(model, tokens[:, i : i + 1], None, cache) for i in range(tokens.shape[1])]
    return out
