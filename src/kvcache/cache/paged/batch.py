"""PagedBatch: one step of many rows of a PagedCache, their blocks reserved already (the engine's
pool reserves a whole step's blocks before any forward): what a backend runs in one call
(`Backend.step`). Row r runs `tokens[r]` (one token when it decodes, a chunk of its prompt
when it prefills) at positions starts[r], starts[r] + 1, …; the logits of the rows that `sample`
are wanted. The forward only reads the block tables and writes the reserved slots; the owner
commits the positions afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CacheShapeError


@dataclass
class PagedBatch:
    """rows: indices into cache.rows, each once; tokens: each row's new token ids (>= 1 each);
    sample: whether each row's last token's logits are wanted. starts: each row's length before
    the step (read from the cache when the batch is made)."""

    cache: object  # the PagedCache
    rows: list[int]
    tokens: list[list[int]]
    sample: list[bool]
    starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        rows = len(self.rows)
        if not (rows == len(self.tokens) == len(self.sample)) or len(set(self.rows)) != rows:
            raise CacheShapeError(
                f"a batch needs distinct rows with tokens and a sample flag each; got {len(self.rows)} "
                f"rows, {len(self.tokens)} token lists, {len(self.sample)} flags"
            )
        if any(not tokens for tokens in self.tokens):
            raise CacheShapeError("every row of a batch runs at least one token")
        lengths = self.cache.row_lengths
        self.starts = [lengths[row] for row in self.rows]

    @property
    def sampled(self) -> list[int]:
        """Batch positions of the rows whose logits are wanted, in order."""
        return [index for index, wanted in enumerate(self.sample) if wanted]

    @property
    def totals(self) -> list[int]:
        """Each row's length after the step."""
        return [start + len(tokens) for start, tokens in zip(self.starts, self.tokens)]

    def view(self, positions: Sequence[int]):
        """A view (`PagedCache.view`) of the batch's rows at these batch positions, for a model
        forward over just them."""
        return self.cache.view([self.rows[index] for index in positions])
