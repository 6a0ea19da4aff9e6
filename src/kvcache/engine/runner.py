"""The engine's runner, its one door to the model: a step's batch run by the backend in one call
(`Backend.step`), then the next token of every row that samples, chosen in one batched call
(`kvcache.generation.sampling.choose_tokens`, each row with its own settings; a row draws from
its own generator only when its request gave a seed). The masks of the rows that follow a grammar
(structured outputs) are computed on a thread of their own while the forward runs
(`masks_ahead`): they depend only on the tokens already chosen."""

from __future__ import annotations

import random
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvcache.engine.pool import StepWork
from kvcache.engine.request import Request
from kvcache.generation.logprobs import token_logprobs
from kvcache.generation.sampling import choose_tokens, finite_rows
from kvcache.generation.structured import allowed_rows, packed_masks


class Runner:
    """Runs steps of `model` on `backend` (built from it)."""

    def __init__(self, model, backend, seed: int | None = None) -> None:
        self.model, self.backend = model, backend
        # the generator of every row whose request gave no seed
        self.shared = torch.Generator().manual_seed(random.randrange(2**62) if seed is None else seed)
        self._masker: ThreadPoolExecutor | None = None  # computes grammars' masks (made at the first)

    def masks_ahead(self, requests: list[Request]) -> Future | None:
        """Start computing the masks of `requests` that follow a grammar (the step's sampling rows,
        in order); the future gives a list of (vocab,) bool or None per request. None: no grammar."""
        if all(request.grammar is None for request in requests):
            return None
        if self._masker is None:
            self._masker = ThreadPoolExecutor(1, thread_name_prefix="kvcache-grammar")
        return self._masker.submit(_allowed, [request.grammar for request in requests])

    def close(self) -> None:
        """Let the mask thread go (it ends once idle)."""
        if self._masker is not None:
            self._masker.shutdown(wait=False)
            self._masker = None

    def run(self, work: StepWork) -> torch.Tensor:
        """(rows that sample, vocab) float32 logits of the step (raises what the forward raises)."""
        with torch.inference_mode():
            return self.backend.step(self.model, work.batch)

    def choose(self, logits: torch.Tensor, requests: list[Request], masks: Future | None = None
               ) -> tuple[list, list]:
        """The next token of each request from its row of logits (and its grammar's mask from
        `masks`, `masks_ahead`'s future): ([(request, token, its TokenLogprobs or None)], [(request,
        error message)]); a row whose logits are not finite (NaN, inf) fails alone. The log-probs
        are computed, in one batch, for the requests that ask (params.logprobs)."""
        allowed = [None] * len(requests) if masks is None else masks.result()
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
            [allowed[row] for row in good],
        )
        tokens = tokens.tolist()
        logprobs: list = [None] * len(picked)
        asking = [at for at, request in enumerate(picked) if request.params.logprobs is not None]
        if asking:
            rows = [good[at] for at in asking]
            found = token_logprobs(logits[rows], [tokens[at] for at in asking],
                                   [picked[at].params.logprobs for at in asking])
            for at, entry in zip(asking, found):
                logprobs[at] = entry
        return list(zip(picked, tokens, logprobs)), failed


def _allowed(states: list) -> list[np.ndarray | None]:
    """Each grammar state's (vocab,) bool mask of the tokens it allows (None where no grammar)."""
    following = [state for state in states if state is not None]
    table = following[0].table
    rows = iter(allowed_rows(packed_masks(following, table.words), table.vocab_size))
    return [None if state is None else next(rows) for state in states]
