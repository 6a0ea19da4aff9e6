"""What changes a batch's raw logits before temperature: each row's logit_bias and its presence,
frequency and repetition penalties (`SamplingParams`), applied in place to the rows that ask, in
a few batched tensor operations. A penalty reads the tokens its row has seen through
`SeenTokens`, which counts them once and then only the new ones."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.generation.params import SamplingParams


class SeenTokens:
    """The tokens one sequence has seen: `tokens`, a list its owner appends each new token to,
    whose first `prompt_length` are the prompt. Gives (vocab,) tensors: the output's counts (the
    tokens after the prompt), counted incrementally, and a mask of the prompt's tokens."""

    def __init__(self, tokens: list[int], prompt_length: int) -> None:
        self.tokens, self.prompt_length = tokens, prompt_length
        self._counts: torch.Tensor | None = None  # (vocab,) int32
        self._counted = 0  # output tokens in _counts
        self._prompt: torch.Tensor | None = None  # (vocab,) bool

    def output_counts(self, vocab_size: int) -> torch.Tensor:
        """(vocab,) int32: how many times each token was generated so far."""
        output = len(self.tokens) - self.prompt_length
        if self._counts is None or self._counts.shape[0] != vocab_size or output < self._counted:
            self._counts, self._counted = torch.zeros(vocab_size, dtype=torch.int32), 0
        if output > self._counted:
            new = torch.tensor(self.tokens[self.prompt_length + self._counted :], dtype=torch.long)
            self._counts.index_add_(0, new, torch.ones(len(new), dtype=torch.int32))
            self._counted = output
        return self._counts

    def prompt_mask(self, vocab_size: int) -> torch.Tensor:
        """(vocab,) bool: which tokens the prompt holds."""
        if self._prompt is None or self._prompt.shape[0] != vocab_size:
            self._prompt = torch.zeros(vocab_size, dtype=torch.bool)
            self._prompt[torch.tensor(self.tokens[: self.prompt_length], dtype=torch.long)] = True
        return self._prompt


def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], seen: Sequence[SeenTokens | None]
) -> None:
    """Add each row's logit_bias to logits (B, vocab) float32, then apply its repetition,
    frequency and presence penalties, in place; rows that ask for none are not touched."""
    biased = [(row, p.logit_bias) for row, p in enumerate(params) if p.logit_bias]
    if biased:
        rows = torch.tensor([row for row, bias in biased for _ in bias])
        ids = torch.tensor([token for _, bias in biased for token, _ in bias])
        values = torch.tensor([value for _, bias in biased for _, value in bias], dtype=logits.dtype)
        logits.index_put_((rows, ids), values, accumulate=True)
    penalized = [row for row, p in enumerate(params) if p.penalizes]
    if penalized:
        logits[penalized] = _penalized(logits[penalized], [params[row] for row in penalized],
                                       [seen[row] for row in penalized])


def _penalized(logits: torch.Tensor, params: list[SamplingParams], seen: list) -> torch.Tensor:
    """logits (P, vocab) after each row's repetition, frequency and presence penalties."""
    vocab = logits.shape[-1]
    if any(tokens is None for tokens in seen):
        raise ValueError("a row with a penalty needs the tokens it has seen (a SeenTokens)")
    counts = torch.stack([tokens.output_counts(vocab) for tokens in seen])  # (P, vocab) int32
    generated = counts > 0
    repeating = [p.repetition_penalty != 1 for p in params]
    if any(repeating):
        nothing = torch.zeros(vocab, dtype=torch.bool)
        prompt = torch.stack([tokens.prompt_mask(vocab) if on else nothing
                              for tokens, on in zip(seen, repeating)])  # (P, vocab)
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype)[:, None]
        penalty = torch.where(generated | prompt, penalty, 1.0)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype)[:, None]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype)[:, None]
    logits = logits - frequency * counts - presence * generated
    largest = torch.finfo(logits.dtype).max  # a tiny repetition penalty must not make inf
    return logits.clamp_(-largest, largest)
