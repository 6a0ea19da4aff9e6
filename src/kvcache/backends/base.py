"""What a backend is: one step over the rows of a paged cache, `step(model, batch) -> logits`."""

from __future__ import annotations

import torch


class BackendError(ValueError):
    """A backend that cannot run this model, or a backend name that does not exist."""


class Backend:
    """One step of a `kvcache.cache.PagedBatch`: any mix of decode rows (one new token each) and
    prompt chunks over block tables reserved before, as the engine runs it and as `generate`
    runs a one-request step (reserve -> step -> commit). A backend is built from a model and
    computes that model's forward; the generation loop and the engine are handed one explicitly
    (`kvcache.backends.choose_backend`).
    """

    #: the name a summary prints ("torch", "float32", "half", "blocks")
    name: str = ""
    #: whether a step of any size gives each token the logits it gets run alone, to the bit
    #: (chunk-invariant arithmetic: what a speculative step's verification needs to be exact, and
    #: what makes a cached prefix's answer the uncached one's whatever the chunks it ran in);
    #: False where the products or the attention sum in another order for more rows
    chunk_invariant: bool = False

    def step(self, model, batch) -> torch.Tensor:
        """(wanted tokens, vocab) float32 logits of one step over `batch` (a `PagedBatch`: rows of
        a paged cache, each running its new tokens, one when it decodes, a prompt chunk when it
        prefills, on blocks reserved before), the logits of the tokens it wants (`PagedBatch.wanted`:
        each sampling row's last token, a verifying row's last `sample[r]`), in order; every
        row's keys and values written to its reserved slots (the caller commits them). `model` is
        the one the backend was built from."""
        raise NotImplementedError

    def matches(self, model) -> bool:
        """Whether this backend computes `model`'s step: it was built from that model, and the
        model has not changed since in a way the backend would miss."""
        raise NotImplementedError
