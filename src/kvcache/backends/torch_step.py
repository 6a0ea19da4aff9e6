"""TorchBackend: the model's own forward as the decode step (any dtype, any device)."""

from __future__ import annotations

import torch

from kvcache.backends.base import DecodeBackend


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
        out = self.model(
            input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=1
        )
        return out.logits[:, -1].float()
