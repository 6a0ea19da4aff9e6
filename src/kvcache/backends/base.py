"""What a decode backend is: one step of B rows, one new token each, through the cache seam."""

from __future__ import annotations

import contextlib

import torch


class BackendError(ValueError):
    """A backend that cannot run this model, or a backend name that does not exist."""


class DecodeBackend:
    """One decode step for B rows, each one new token, each row at its own position.

    `decode(input_ids (B, 1), cache, attention_mask=None) -> logits (B, vocab)` float32: the last
    (only) position's logits, after the cache took the rows' keys and values. attention_mask
    (B, past + 1), 1 = token, 0 = left padding, as the model takes it; without one every row's
    token sits at the row's own length (in a paged cache rows may differ). A backend is built
    from a model and computes that model's forward; the generation loop and the engine are handed
    one explicitly (`kvcache.backends.choose_backend`).
    """

    #: the name a summary prints ("torch", "numpy")
    name: str = ""

    def decode(
        self, input_ids: torch.Tensor, cache, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise NotImplementedError

    def step(self, model, batch) -> torch.Tensor:
        """(sampled rows, vocab) float32 logits of one engine step over `batch` (a
        `kvcache.cache.PagedBatch`: rows of a paged cache, each running its new tokens, one when
        it decodes, a prompt chunk when it prefills, on blocks reserved before), the logits of
        the rows that sample, in order. `model` is the one the backend was built from."""
        raise NotImplementedError

    @staticmethod
    def check_step_ids(input_ids: torch.Tensor) -> None:
        """Raise ValueError unless input_ids is (batch, 1): one new token per row."""
        if input_ids.dim() != 2 or input_ids.shape[1] != 1:
            raise ValueError(f"a decode step takes input_ids (batch, 1), got shape {tuple(input_ids.shape)}")

    def matches(self, model) -> bool:
        """Whether this backend computes `model`'s decode step: it was built from that model, and
        the model has not changed since in a way the backend would miss."""
        raise NotImplementedError

    def prompt_products(self) -> contextlib.AbstractContextManager:
        """The context the model's forward of a prompt runs in (`torch_step.last_logits`): a
        backend that keeps its own laid-out copy of the weights lends it to the forward's
        products (`prompt_products.PromptProducts`); here nothing."""
        return contextlib.nullcontext()
