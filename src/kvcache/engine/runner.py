"""The engine's runner, its one door to the model: a step's batch run by the backend in one call
(`DecodeBackend.step`), then the next token of every row that samples, chosen in one batched call
(`kvcache.generation.sampling.choose_tokens`, each row with its own settings; a row draws from
its own generator only when its request gave a seed)."""

from __future__ import annotations

import random

import torch

from kvcache.engine.pool import StepWork
from kvcache.engine.request import Request
from kvcache.generation.sampling import choose_tokens, finite_rows


class Runner:
    """Runs steps of `model` on `backend` (built from it)."""

    def __init__(self, model, backend, seed: int | None = None) -> None:
        self.model, self.backend = model, backend
        # the generator of every row whose request gave no seed
        self.shared = torch.Generator().manual_seed(random.randrange(2**62) if seed is None else seed)

    def run(self, work: StepWork) -> torch.Tensor:
        """(rows that sample, vocab) float32 logits of the step (raises what the forward raises)."""
        with torch.inference_mode():
            return self.backend.step(self.model, work.batch)

    def choose(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list, list]:
        """The next token of each request from its row of logits: ([(request, token)], [(request,
        error message)]); a row whose logits are not finite (NaN, inf) fails alone."""
        finite = finite_rows(logits).tolist()
        good = [row for row, ok in enumerate(finite) if ok]
        failed = [
            (requests[row], "NonFiniteLogitsError: the model's logits are not finite (NaN or inf)")
            for row, ok in enumerate(finite)
            if not ok
        ]
        if not good:
            return [], failed
        picked = [requests[row] for row in good]
        tokens = choose_tokens(
            logits[good] if len(good) < len(requests) else logits,
            [request.params for request in picked],
            [request.generator for request in picked],
            self.shared,
            [request.seen for request in picked],
        )
        return list(zip(picked, tokens.tolist())), failed
