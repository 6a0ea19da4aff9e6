"""TorchBackend: the model's own forward as the step (any dtype, any device): the reference road."""

from __future__ import annotations

import torch

from kvcache.backends.base import Backend
from kvcache.cache.paged.rows import prefill_inputs


def last_logits(model, input_ids: torch.Tensor, attention_mask, cache, keep: int = 1) -> torch.Tensor:
    """(B, vocab) float logits of the last position after running input_ids (B, T) on `cache`
    through the model's forward (attention_mask: (B, past + T) or None); keep > 1: (B, keep,
    vocab), the last `keep` positions'."""
    out = model(
        input_ids, attention_mask=attention_mask, past_key_values=cache, use_cache=True, logits_to_keep=keep
    )
    return out.logits[:, -1].float() if keep == 1 else out.logits[:, -keep:].float()


def forward_rows(model, batch) -> torch.Tensor:
    """`Backend.step` on the model's forward: the rows of one new token as one batched forward,
    each longer row (a prompt chunk) a forward of its own (a prompt is bound by arithmetic, so
    chunks batched together would only add padding), through reserved views of the batch's rows
    (`PagedCache.view`). (wanted tokens, vocab) float32 (`PagedBatch.wanted`)."""
    logits: dict[int, torch.Tensor] = {}  # each row's (its wanted tokens, vocab)
    singles = [index for index, tokens in enumerate(batch.tokens) if len(tokens) == 1]
    if singles:
        ids = torch.tensor([batch.tokens[index] for index in singles], device=batch.cache.device)  # (B, 1)
        for index, row_logits in zip(singles, last_logits(model, ids, None, batch.view(singles))):
            logits[index] = row_logits[None]
    for index, tokens in enumerate(batch.tokens):
        if len(tokens) > 1:
            view = batch.view([index])
            ids, mask = prefill_inputs(view, [tokens])
            keep = max(1, batch.sample[index])
            logits[index] = last_logits(model, ids, mask, view, keep).reshape(keep, -1)
    sampled = batch.sampled
    if not sampled:
        return torch.empty((0, model.config.vocab_size))
    return torch.cat([logits[index][-batch.sample[index]:] for index in sampled])


class TorchBackend(Backend):
    """Steps through `model(...)`: the reference road, which runs the model's modules as they are
    (hooks, subclasses and all). Built for free; it keeps the model it was given."""

    name = "torch"

    def __init__(self, model) -> None:
        self.model = model

    def step(self, model, batch) -> torch.Tensor:
        """One step on the model's forward (`forward_rows`)."""
        return forward_rows(model, batch)

    def matches(self, model) -> bool:
        """It calls the model it keeps: it matches that model, whatever it has become."""
        return model is self.model
