"""Model-free speculative decoding on `generate`'s paged road: prompt lookup drafts, verified in
one step, exact by construction.

Each decode step, `NgramDrafts` looks for the longest recent n-gram of the sequence (prompt and
output) that ends it and occurred before; the tokens that followed that earlier occurrence are
the draft. One paged step runs the row's newest token and the draft together and returns the
logits after every one of them (`PagedBatch.sample`): the token chosen after the newest token is
the first draft token's check, and so on. While the chosen tokens equal the draft, their logits
are already there; at the first that differs the draft's rest is trimmed from the cache
(`PagedCache.truncate_rows`) and the next step drafts again.

Greedy tokens are the tokens of decoding one at a time, to the bit, because the backend's
steps are chunk-invariant (`Backend.chunk_invariant`: a token's logits the same whether it runs
alone or beside others of its row); a backend without that property is refused. The draft
length adapts to what drafts give and what a longer step costs (`DraftLength`): where drafts
are seldom taken it drafts nothing, so text that never repeats itself runs as plain decoding
does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from kvcache.generation.paged_steps import PagedSteps

#: the most tokens a draft holds unless the caller says: its verify step (16 tokens) still runs
#: on the layer kernels (`CpuBackend.kernel_rows`)
DRAFT_TOKENS = 15


class NgramDrafts:
    """Prompt lookup: the continuation of the latest earlier occurrence of the sequence's last
    n tokens (n from `longest` down to `shortest`), as in llama.cpp's and vLLM's n-gram drafts."""

    def __init__(self, longest: int = 8, shortest: int = 1) -> None:
        if not 1 <= shortest <= longest:
            raise ValueError(f"n-gram lengths must satisfy 1 <= shortest <= longest, got {shortest}, "
                             f"{longest}")
        self.longest, self.shortest = longest, shortest
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest earlier occurrence ends

    def extend(self, tokens: Sequence[int]) -> None:
        """Add tokens to the sequence; each n-gram becomes findable once a token follows it."""
        for token in tokens:
            end = len(self.tokens)  # n-grams ending here are now followed by `token`
            for n in range(self.shortest, min(self.longest, end) + 1):
                self.seen[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(token)

    def draft(self, count: int) -> list[int]:
        """Up to `count` tokens that followed the longest n-gram ending the sequence, where it
        occurred last before (none: [])."""
        end = len(self.tokens)
        for n in range(min(self.longest, end), self.shortest - 1, -1):
            found = self.seen.get(tuple(self.tokens[end - n :]))
            if found is not None:
                return self.tokens[found : found + count]
        return []


class DraftLength:
    """How many tokens to draft next, from what drafts have cost and given: the length k that
    makes the most tokens per unit of step time, (1 + p + … + p^k) / (1 + slope·k), where p is
    the chance that a draft token is taken (a running average over the row's verified drafts)
    and slope what each further token of a step costs, relative to a step of one token (measured
    on the steps as they run). Where no length pays (p low), it drafts nothing: plain decoding;
    p drifts back to its prior while nothing is drafted, so a later stretch of repeated text is
    tried again."""

    #: the chance a draft token is taken, before any draft was verified
    PRIOR = 0.6
    #: how far each verified token (and each plain step, back toward the prior) moves p
    RATE = 0.1
    #: what a step's further token costs, relative to a one-token step, before any was timed
    SLOPE = 0.5

    def __init__(self, most: int) -> None:
        self.most = most
        self.taken_chance = self.PRIOR
        self.slope = self.SLOPE
        self.single = 0.0  # the seconds a one-token step takes (a running average; 0: none timed yet)

    def next(self) -> int:
        """Tokens to draft this step (0: decode plainly)."""
        p, best, best_rate = self.taken_chance, 0, 1.0
        expected = 1.0
        for k in range(1, self.most + 1):
            expected += p**k
            rate = expected / (1.0 + self.slope * k)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def taken(self, drafted: int, accepted: int) -> None:
        """Note a verified draft of `drafted` tokens of which the first `accepted` were chosen
        (the first refused one, if any, counts against p; the untried rest do not)."""
        for _ in range(accepted):
            self.taken_chance += self.RATE * (1.0 - self.taken_chance)
        if accepted < drafted:
            self.taken_chance -= self.RATE * self.taken_chance
        if not drafted:
            self.taken_chance += self.RATE * (self.PRIOR - self.taken_chance)

    def timed(self, tokens: int, seconds: float) -> None:
        """Note that a step of `tokens` tokens (the row's own and its draft) took `seconds`."""
        if tokens == 1:
            self.single = seconds if not self.single else self.single + self.RATE * (seconds - self.single)
        elif self.single:
            slope = max(0.0, (seconds / self.single - 1.0) / (tokens - 1))
            self.slope += self.RATE * (slope - self.slope)


class SpeculativeSteps:
    """`PagedSteps` of one row whose decode steps verify n-gram drafts (see the module docstring).
    `decode` takes the chosen token and gives the logits after it, as `PagedSteps.decode` does.
    most: the longest draft; new_tokens: the tokens the call chooses at most (no draft runs past
    the positions plain decoding would fill, which is what the cache was sized for)."""

    def __init__(self, steps: PagedSteps, most: int, new_tokens: int) -> None:
        self.steps, self.new_tokens = steps, new_tokens
        self.limit = 0  # the most positions the row holds: what plain decoding leaves in it
        self.drafts = NgramDrafts()
        self.length = DraftLength(most)
        self.pending: list[tuple[int, torch.Tensor]] = []  # (draft token, the logits after it)
        self.drafted = 0  # tokens the last verification drafted, of which `accepted` were chosen
        self.accepted = 0
        self.held = steps.cache.row_lengths[0]  # positions of chosen tokens the cache holds or runs
        self.drafted_total = 0  # draft tokens verified, in all
        self.accepted_total = 0  # of them, the ones chosen

    def prefill(self, tokens: Sequence[Sequence[int]], chunk_size: int | None) -> torch.Tensor:
        """`PagedSteps.prefill` of the one row, its tokens the first the drafts look through."""
        logits = self.steps.prefill(tokens, chunk_size)
        self.drafts.extend(tokens[0])
        self.held = self.steps.cache.row_lengths[0]
        self.limit = self.held + self.new_tokens - 1
        return logits

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """(1, vocab) logits after the chosen token tokens (1,)."""
        token = int(tokens[0])
        self.drafts.extend([token])
        self.held += 1
        if self.pending and self.pending[0][0] == token:
            self.accepted += 1
            return self.pending.pop(0)[1][None]
        self._settle(self.held - 1)  # (the newest token runs now)
        draft = self.drafts.draft(min(self.length.next(), self.limit - self.held))
        started = time.perf_counter()
        logits = self.steps.verify([token, *draft])  # (1 + drafted, vocab)
        self.length.timed(1 + len(draft), time.perf_counter() - started)
        self.pending = list(zip(draft, logits[1:]))
        self.drafted, self.accepted = len(draft), 0
        return logits[:1]

    def _settle(self, keep: int) -> None:
        """The last verification's verdict noted, and the cache trimmed to `keep` positions (its
        rejected draft tokens dropped)."""
        self.length.taken(self.drafted, self.accepted)
        self.drafted_total += self.drafted
        self.accepted_total += self.accepted
        self.drafted = 0
        self.pending = []
        if self.steps.cache.row_lengths[0] > keep:
            self.steps.cache.truncate_rows([keep])

    def finish(self) -> None:
        """Trim what no chosen token confirmed: the cache holds the chosen tokens but the last,
        as plain decoding leaves it."""
        self._settle(self.held)

    def undo(self) -> None:
        """`PagedSteps.undo`."""
        self.steps.undo()
