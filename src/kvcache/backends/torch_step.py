"""TorchBackend: the model's own forward as the decode step (any dtype, any device)."""

from __future__ import annotations

import contextlib

import torch

from kvcache.backends.base import DecodeBackend
from kvcache.backends.float16_products import float32_products


def last_logits(model, input_ids: torch.Tensor, attention_mask, cache, backend=None) -> torch.Tensor:
    """(B, vocab) float logits of the last position after running input_ids (B, T) on `cache`
    through the model's forward (attention_mask: (B, past + T) or None). A float16 model on CPU
    runs the products and attention of many rows in float32 (`float16_products`); `backend`, the
    model's DecodeBackend when given, may lend the forward its laid-out weights
    (`DecodeBackend.prompt_products`)."""
    lent = contextlib.nullcontext() if backend is None else backend.prompt_products()
    with float32_products(model, input_ids.numel()), lent:
        out = model(
            input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
    return out.logits[:, -1].float()


class TorchBackend(DecodeBackend):
    """Decode steps through `model(...)`: the reference path, which runs the model's modules as
    they are (hooks, subclasses and all). Built for free; it keeps the model it was given."""

    name = "torch"

    def __init__(self, model) -> None:
        self.model = model

    def decode(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(B, vocab) float32 logits of one decode step of input_ids (B, 1) on `cache`."""
        return last_logits(self.model, input_ids, attention_mask, cache)

    def matches(self, model) -> bool:
        """It calls the model it keeps: it matches that model, whatever it has become."""
        return model is self.model
