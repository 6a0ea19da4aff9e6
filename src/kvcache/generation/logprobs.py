"""The log-probabilities a request asks for (OpenAI's logprobs / top_logprobs): for each chosen
token, its log-probability and the `top` likeliest tokens', read from the model's own
distribution, log_softmax of the raw logits (before a grammar's mask, logit_bias, penalties,
temperature and the filters: vLLM's default, "raw_logprobs"). Batched over the rows that ask; the
top ones found by a partition, not a sort of the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """One chosen token, its log-probability, and the likeliest tokens' (id, logprob), best first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int]) -> list[TokenLogprobs]:
    """logits (R, vocab) of the rows that ask, their chosen tokens (R,), and how many of the
    likeliest tokens each wants (tops[r] >= 0) -> each row's TokenLogprobs."""
    logprobs = torch.log_softmax(logits.float(), dim=-1).numpy()  # (R, vocab)
    rows = np.arange(len(tokens))
    chosen = logprobs[rows, np.asarray(tokens)]  # (R,)
    most = min(max(tops, default=0), logprobs.shape[-1])
    if most == 0:
        return [TokenLogprobs(token, float(value)) for token, value in zip(tokens, chosen)]
    best = np.argpartition(-logprobs, most - 1, axis=-1)[:, :most]  # (R, most), unordered
    values = np.take_along_axis(logprobs, best, axis=-1)
    order = np.argsort(-values, axis=-1, kind="stable")  # (R, most): a sort of `most` only
    best, values = np.take_along_axis(best, order, -1), np.take_along_axis(values, order, -1)
    return [
        TokenLogprobs(token, float(value), tuple(zip(best[row, :top].tolist(), values[row, :top].tolist())))
        for row, (token, value, top) in enumerate(zip(tokens, chosen, tops))
    ]
