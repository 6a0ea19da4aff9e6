"""PagedBatch: one step of many rows of a PagedCache, their blocks reserved already (the engine's
pool reserves a whole step's blocks before any forward): what a backend runs in one call
(`Backend.step`). Row r runs `tokens[r]` (one token when it decodes, a chunk of its prompt
when it prefills) at positions starts[r], starts[r] + 1, …; the logits of each row's last
`sample[r]` tokens are wanted (one: its next token; more: a speculative step's drafts verified).
The forward only reads the block tables and writes the reserved slots; the owner commits the
positions afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import CacheShapeError


@dataclass
class PagedBatch:
    """rows: indices into cache.rows, each once; tokens: each row's new token ids (>= 1 each);
    sample: how many of each row's last tokens' logits are wanted (True/1: its last token's;
    False/0: none), at most its tokens. starts: each row's length before the step (read from the
    cache when the batch is made)."""

    cache: object  # the PagedCache
    rows: list[int]
    tokens: list[list[int]]
    sample: list[int]  # (bools count as 0 and 1)
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
        for index, (wanted, tokens) in enumerate(zip(self.sample, self.tokens)):
            if not 0 <= wanted <= len(tokens):
                raise CacheShapeError(
                    f"sample[{index}] must be 0 .. the row's {len(tokens)} tokens, got {wanted}")
        lengths = self.cache.row_lengths
        self.starts = [lengths[row] for row in self.rows]

    @property
    def sampled(self) -> list[int]:
        """Batch positions of the rows whose logits are wanted, in order."""
        return [index for index, wanted in enumerate(self.sample) if wanted]

    @property
    def wanted(self) -> list[tuple[int, int]]:
        """(batch position, token index within the row) of every token whose logits are wanted,
        in the order a step returns them: row by row, each row's last `sample[r]` tokens in order."""
        return [(index, len(tokens) - wanted + k) for index, (tokens, wanted) in
                enumerate(zip(self.tokens, self.sample)) for k in range(wanted)]

    @property
    def totals(self) -> list[int]:
        """Each row's length after the step."""
        return [start + len(tokens) for start, tokens in zip(self.starts, self.tokens)]

    def view(self, positions: Sequence[int]):
        """A view (`PagedCache.view`) of the batch's rows at these batch positions, for a model
        forward over just them."""
        return self.cache.view([self.rows[index] for index in positions])
