"""Choosing the next tokens of a batch from its logits, each row with its own `SamplingParams`, in
one call: pure functions of (logits, params, generators).

Nothing here keeps state or touches a global seed: a row draws from its own `torch.Generator`
when it has one (a request with a seed), the others from the one shared generator given, so the
same generator states give the same tokens. A row with a grammar (structured outputs) first
loses the tokens its mask does not allow (-inf). The raw logits then take each row's logit_bias and
penalties (`kvcache.generation.penalties`, as vLLM orders them); the filters then follow the
order Hugging Face applies them: temperature, then top-k, top-p and min-p. A row that asks for
none of these costs only its share of one argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from kvcache.backends.cpu.threads import torch_threads
from kvcache.generation.params import SamplingParams
from kvcache.generation.penalties import SeenTokens, adjust_logits


class NonFiniteLogitsError(ValueError):
    """The model's logits hold NaN or inf: no token can be chosen from them (argmax of NaN is
    token 0, a stream of it looks like an answer)."""


def top_k_filter(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's top_k[row] scores (top_k (B,) long, each >= 1); the rest become -inf (ties
    at the k-th score are kept)."""
    most = min(int(top_k.max()), logits.shape[-1])
    best = torch.topk(logits, most, dim=-1).values  # (B, most)
    kth = best.gather(-1, (top_k.clamp(max=most) - 1)[:, None])  # (B, 1)
    return logits.masked_fill(logits < kth, float("-inf"))


#: the best scores `top_p_filter` ranks first; four times more until every row's kept set lies
#: within (past a sixteenth of the vocabulary: all of it)
TOP_P_FIRST = 256


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of highest-probability tokens whose mass reaches top_p[row]
    (top_p (B,) in (0, 1]; at least one token). No sort of the vocabulary: the row's best k
    scores (`torch.topk`, k grown until the mass of every row's kept set is reached within
    them), their probabilities against the whole row's normalizer (logsumexp), summed in float64
    (a float32 sum over a flat row's tens of thousands of kept tokens moves its boundary)."""
    vocab = logits.shape[-1]
    partial = top_p[:, None] < 1  # a row of top_p 1 keeps every token (a float32 sum may reach
    # 1 before its tail)
    normalizer = torch.logsumexp(logits.double(), dim=-1, keepdim=True)  # (B, 1)
    k = min(TOP_P_FIRST, vocab)
    while True:
        best, order = torch.topk(logits, k, dim=-1)  # (B, k), best first
        probs = (best.double() - normalizer).exp()
        mass_before = probs.cumsum(dim=-1) - probs  # probability of the better tokens
        keep = (mass_before < top_p[:, None]) | ~partial  # (the first token: mass_before 0)
        if k == vocab or not bool((keep[:, -1] & partial[:, 0]).any()):
            break  # every partial row drops its k-th best already: its kept set lies within
        k = 4 * k if 4 * k <= vocab // 16 else vocab  # (a flat row: one sort, not many ranks)
    kept = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, keep)
    return logits.masked_fill(~kept & partial, float("-inf"))


def min_p_filter(logits: torch.Tensor, log_min_p: torch.Tensor) -> torch.Tensor:
    """Drop (to -inf) each row's tokens less likely than min_p times its likeliest one, given
    log_min_p (B,) = log(min_p) <= 0 (-inf: keep all): those below the row's max + log(min_p);
    no sort. (The log is taken in float64 first: a min_p of 1e-60 is 0 in float32.)"""
    floor = logits.max(dim=-1, keepdim=True).values + log_min_p[:, None]  # (B, 1)
    return logits.masked_fill(logits < floor, float("-inf"))


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """(B,) bool: which rows of logits (B, vocab) hold only finite numbers (on the CPU through
    numpy, several times faster than torch's isfinite on a vocabulary-wide row)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(np.isfinite(logits.numpy()).all(axis=-1))
    return torch.isfinite(logits).all(dim=-1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """(B,) each row's highest-scoring token (the first of equal ones, as torch's argmax)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def choose_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None] | None = None,
    shared: torch.Generator | None = None,
    seen: Sequence[SeenTokens | None] | None = None,
    allowed: Sequence[np.ndarray | None] | None = None,
) -> torch.Tensor:
    """(B, vocab) last-position logits -> (B,) next tokens, row b chosen as params[b] says: the
    argmax of `processed_logits` when greedy, else a draw from their softmax, from generators[b]
    when given, else from `shared` (None: torch's default generator). seen[b]: the tokens row b
    has seen, needed when it has a penalty. allowed[b]: (vocab,) bool, the only tokens row b may
    take (its grammar's mask), or None. Raises `NonFiniteLogitsError` when a row holds NaN
    or inf. Runs on one torch thread: the work is a few passes over B × vocab floats, and right
    after a step on other threads a second torch thread would wait for a core."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"{len(params)} sampling params for {logits.shape[0]} rows of logits")
    finite = finite_rows(logits)
    if not bool(finite.all()):
        rows = (~finite).nonzero().flatten().tolist()
        raise NonFiniteLogitsError(
            f"the model's logits are not finite (NaN or inf) in batch rows {rows}: its weights or "
            f"inputs are broken (a float16 overflow, a corrupt checkpoint?); no token is chosen"
        )
    generators = generators if generators is not None else [None] * len(params)
    seen = seen if seen is not None else [None] * len(params)
    allowed = allowed if allowed is not None else [None] * len(params)
    with torch_threads(1):
        tokens = _argmax(logits)  # (B,)
        rows = [row for row, p in enumerate(params)
                if p.adjusts_logits or not p.greedy or allowed[row] is not None]
        if rows:
            every = len(rows) == len(params)
            chosen = logits.to(torch.float32, copy=True) if every else logits[rows].float()
            _mask(chosen, [allowed[row] for row in rows])
            chosen = _processed(chosen, [params[row] for row in rows], [seen[row] for row in rows])
            argmax = [at for at, row in enumerate(rows) if params[row].greedy]
            if argmax:
                tokens[[rows[at] for at in argmax]] = _argmax(chosen[argmax])
            drawn = [at for at, row in enumerate(rows) if not params[row].greedy]
            if drawn:
                probs = chosen.softmax(-1) if len(drawn) == len(rows) else chosen[drawn].softmax(-1)
                own = [generators[rows[at]] for at in drawn]
                tokens[[rows[at] for at in drawn]] = _draw(probs, own, shared)
    return tokens


def processed_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seen: Sequence[SeenTokens | None] | None = None,
) -> torch.Tensor:
    """A float32 copy of logits (B, vocab) as `choose_tokens` chooses from them: each row's
    logit_bias and penalties on the raw logits; then, for the rows that sample, temperature,
    top-k, top-p and min-p (dropped tokens -inf)."""
    seen = seen if seen is not None else [None] * len(params)
    return _processed(logits.to(torch.float32, copy=True), list(params), list(seen))


def _mask(logits: torch.Tensor, allowed: list) -> None:
    """Set to -inf, in place, the tokens of logits (R, vocab) float32 that allowed[r] (vocab,)
    bool does not allow (rows whose allowed is None are not touched)."""
    masked = [row for row, mask in enumerate(allowed) if mask is not None]
    if masked and len(masked) == len(allowed):  # (in place: no gathered copy of the rows to write back)
        logits.masked_fill_(~torch.from_numpy(np.stack(allowed)), float("-inf"))  # (R, vocab) bool
        return
    for row in masked:
        logits[row].masked_fill_(~torch.from_numpy(allowed[row]), float("-inf"))


def _processed(logits: torch.Tensor, params: list[SamplingParams], seen: list) -> torch.Tensor:
    """processed_logits on a float32 tensor the caller gives away (changed in place)."""
    if any(p.adjusts_logits for p in params):
        adjust_logits(logits, params, seen)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if len(drawn) == len(params):
        return _filtered(logits, params)
    if drawn:
        logits[drawn] = _filtered(logits[drawn], [params[row] for row in drawn])
    return logits


def _filtered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """logits (B, vocab) after each row's temperature, top-k, top-p and min-p."""
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures)[:, None]
    if any(p.top_k is not None for p in params):
        vocab = logits.shape[-1]
        logits = top_k_filter(logits, torch.tensor([p.top_k or vocab for p in params]))
    if any(p.top_p < 1.0 for p in params):
        logits = top_p_filter(logits, torch.tensor([p.top_p for p in params], dtype=logits.dtype))
    if any(p.min_p > 0 for p in params):
        logs = [math.log(p.min_p) if p.min_p > 0 else -math.inf for p in params]
        logits = min_p_filter(logits, torch.tensor(logs, dtype=logits.dtype))
    return logits


def _draw(probs: torch.Tensor, generators: list, shared) -> torch.Tensor:
    """(B,) tokens drawn from probs (B, vocab), row b from generators[b] (None: `shared`)."""
    tokens = torch.empty(len(generators), dtype=torch.long)
    own = [row for row, generator in enumerate(generators) if generator is not None]
    rest = [row for row, generator in enumerate(generators) if generator is None]
    for row in own:
        tokens[row] = torch.multinomial(probs[row], num_samples=1, generator=generators[row])[0]
    if rest:
        picked = probs if len(rest) == len(generators) else probs[rest]
        tokens[rest] = torch.multinomial(picked, num_samples=1, generator=shared).squeeze(-1)
    return tokens
