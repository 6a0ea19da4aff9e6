"""`generate`'s fast road: every forward a one-request paged step, as the engine runs one (and
with no cache, `RecomputedSteps`: the whole sequence again each step, on the same backend).

Each row of the batch is a row of a `PagedCache`, holding only its own tokens (no padding). A
forward reserves the rows' blocks, runs the backend's step over a `PagedBatch` (the same
`Backend.step` the engine calls, on the same kernels) and commits what it wrote; a prompt runs
`chunk_size` tokens per row at a time. A step that fails leaves the rows as they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.cache import PagedBatch, PagedCache, make_cache
from kvcache.cache.errors import CacheError


def rows_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[list[int]]:
    """Each row's new tokens of input_ids (B, T), its left padding left out (attention_mask
    (B, held + T) or None: its last T columns are the new tokens')."""
    if attention_mask is None:
        return input_ids.tolist()
    width = input_ids.shape[1]
    return [row[mask[-width:] == 1].tolist() for row, mask in zip(input_ids, attention_mask)]


class PagedSteps:
    """The forwards of one `generate` call on a PagedCache's rows, run by `backend`."""

    def __init__(self, model, backend, cache: PagedCache, batch: int) -> None:
        if cache.layers and not cache.layers[0].allocated:
            raise ValueError("generate runs a PagedCache's steps on its blocks: build the PagedCache "
                             "with its dtype (make_cache('paged', ..., dtype=...)) so they exist")
        self.model, self.backend, self.cache = model, backend, cache
        self.added = not cache.rows
        if self.added:
            for _ in range(batch):
                cache.add_sequence()
        if len(cache.rows) != batch:
            raise ValueError(f"the PagedCache holds {len(cache.rows)} rows; the batch has {batch}")
        self.started = cache.row_lengths  # what each row held before the call

    def prefill(self, tokens: Sequence[Sequence[int]], chunk_size: int | None) -> torch.Tensor:
        """(B, vocab) float32 logits of each row's last token after running tokens[r] on row r,
        at most chunk_size tokens per row per step (None: all at once)."""
        logits: list[torch.Tensor | None] = [None] * len(tokens)
        done = [0] * len(tokens)
        while True:
            rows = [row for row, sent in enumerate(done) if sent < len(tokens[row])]
            if not rows:
                break
            chunks = [list(tokens[row][done[row] : done[row] + (chunk_size or len(tokens[row]))])
                      for row in rows]
            last = [done[row] + len(chunk) == len(tokens[row]) for row, chunk in zip(rows, chunks)]
            batch = PagedBatch(self.cache, rows, chunks, last)
            for index, row_logits in zip(batch.sampled, self._run(batch)):
                logits[rows[index]] = row_logits
            for row, chunk in zip(rows, chunks):
                done[row] += len(chunk)
        return torch.stack(logits)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, vocab) float32 logits after running each row's next token, tokens (B,)."""
        listed = tokens.tolist()
        batch = PagedBatch(self.cache, list(range(len(listed))), [[token] for token in listed],
                           [True] * len(listed))
        return self._run(batch)

    def verify(self, tokens: Sequence[int]) -> torch.Tensor:
        """(len(tokens), vocab) float32 logits after each of tokens, run in one step on the
        only row (a speculative step: its newest token, then a draft)."""
        batch = PagedBatch(self.cache, [0], [list(tokens)], [len(tokens)])
        return self._run(batch)

    def _run(self, batch: PagedBatch) -> torch.Tensor:
        self.cache.reserve(batch.rows, batch.totals)
        logits = self.backend.step(self.model, batch)
        self.cache.commit(batch.rows, batch.totals)
        return logits

    def undo(self) -> None:
        """Put the rows back to what they held before the call (rows it added: freed)."""
        if self.added:
            self.cache.free_rows()
            return
        try:
            self.cache.truncate_rows(self.started)
        except CacheError:  # a window gave back what the row held: it stays ahead
            pass


class RecomputedSteps:
    """The forwards of a `generate` call that keeps no cache (cache="none"), on a backend: every
    forward runs each row's whole sequence so far as a prompt on a fresh paged cache, dropped
    after (the cost a cache saves, measured on the same kernels as the cached road)."""

    def __init__(self, model, backend) -> None:
        self.model, self.backend = model, backend
        self.rows: list[list[int]] = []

    def prefill(self, tokens: Sequence[Sequence[int]], chunk_size: int | None) -> torch.Tensor:
        """(B, vocab) float32 logits after each row's prompt tokens[r]."""
        self.rows = [list(row) for row in tokens]
        return self._run(chunk_size)

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, vocab) float32 logits after each row's whole sequence and its next token (B,)."""
        for row, token in zip(self.rows, tokens.tolist()):
            row.append(token)
        return self._run(None)

    def _run(self, chunk_size: int | None) -> torch.Tensor:
        model = self.model
        cache = make_cache("paged", config=model.config, dtype=model.dtype, device=model.device,
                           max_batch_size=len(self.rows), max_cache_len=max(map(len, self.rows)))
        return PagedSteps(model, self.backend, cache, len(self.rows)).prefill(self.rows, chunk_size)

    def undo(self) -> None:
        """Nothing to put back: nothing is kept."""
