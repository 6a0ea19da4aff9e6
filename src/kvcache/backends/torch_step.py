"""TorchBackend: the model's own forward as the decode step (any dtype, any device)."""

from __future__ import annotations

import contextlib

import torch

from kvcache.backends.base import DecodeBackend
from kvcache.backends.cpu.float16_products import float32_products
from kvcache.cache.paged.rows import prefill_inputs


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


def forward_rows(backend: DecodeBackend, model, batch) -> torch.Tensor:
    """`DecodeBackend.step` on the model's forward: the rows of one new token as one decode step
    of `backend`, each longer row (a prompt chunk) a forward of its own (a prompt is bound by
    arithmetic, so chunks batched together would only add padding), through reserved views of
    the batch's rows. (sampled rows, vocab) float32."""
    logits: dict[int, torch.Tensor] = {}
    singles = [index for index, tokens in enumerate(batch.tokens) if len(tokens) == 1]
    if singles:
        device = batch.cache.device
        ids = torch.tensor([batch.tokens[index] for index in singles], device=device)  # (B, 1)
        for index, row_logits in zip(singles, backend.decode(ids, batch.view(singles))):
            logits[index] = row_logits
    for index, tokens in enumerate(batch.tokens):
        if len(tokens) > 1:
            view = batch.view([index])
            ids, mask = prefill_inputs(view, [tokens])
            logits[index] = last_logits(model, ids, mask, view, backend)[0]
    sampled = batch.sampled
    if not sampled:
        return torch.empty((0, model.config.vocab_size))
    return torch.stack([logits[index] for index in sampled])


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

    def step(self, model, batch) -> torch.Tensor:
        """One engine step on the model's forward (`forward_rows`)."""
        return forward_rows(self, model, batch)

    def matches(self, model) -> bool:
        """It calls the model it keeps: it matches that model, whatever it has become."""
        return model is self.model
