"""A request's prompt as token ids: given as ids, as text, or as chat messages (through the
tokenizer's chat template), each id checked against the vocabulary."""

from __future__ import annotations

import torch

from kvcache.generation.params import RequestError


def prompt_ids(prompt, tokenizer, vocab_size: int) -> list[int]:
    """Token ids of `prompt`: a list or tensor of ids, a text, or chat messages [{"role",
    "content"}, …]. Raises RequestError for an empty prompt, an id outside [0, vocab_size), or
    text without a tokenizer."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], dict)):
        if tokenizer is None:
            raise RequestError("a text or chat prompt needs the engine's tokenizer; pass token ids")
        if isinstance(prompt, str):
            ids = tokenizer.encode(prompt)
        else:
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    else:
        ids = prompt
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
    if not ids:
        raise RequestError("the prompt holds no tokens: give at least one")
    for token in ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise RequestError(f"prompt token ids must be ints in [0, {vocab_size}), got {token!r}")
    return ids
