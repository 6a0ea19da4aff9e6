"""Model-free speculative decoding in the engine: a decoding row drafts tokens by prompt lookup
(`kvcache.generation.speculative.NgramDrafts`, its length from `DraftLength`), the scheduler
gives the draft slots the token budget and the pool can spare (less, or none, when they are
short), and the step runs the row's newest token and its draft beside every other row, asking
for the logits after each of them (`PagedBatch.sample`).

The row's tokens are then chosen one position at a time, each with the sampler and generator
plain decoding uses: while the chosen token equals the draft token, the next position's logits
are already there; at the first that differs (or when the request stops) the rest is dropped.
The step's rejected tail is trimmed from the row before any of the chosen tokens is declared
to the pool, so a draft token's block is never hashed, never findable by a prefix and never
published as a KV event, and the row holds what plain decoding leaves. The tokens are plain
decoding's to the bit because the backend's steps are chunk-invariant
(`Backend.chunk_invariant`); an engine or request asking for speculation elsewhere is refused.
"""

from __future__ import annotations

from collections.abc import Callable

from kvcache.generation.params import RequestError
from kvcache.generation.speculative import DRAFT_TOKENS, DraftLength, NgramDrafts

#: what `Engine(speculate=...)` may name (None: no request speculates unless it asks)
ENGINE_MODES = ("ngram",)


class RowDrafts:
    """One speculating request's drafts: the n-gram index over its tokens (prompt, then output),
    the draft length it has earned, the draft proposed for the coming step, and its counts."""

    def __init__(self, most: int = DRAFT_TOKENS) -> None:
        self.ngrams = NgramDrafts()
        self.length = DraftLength(most)
        self.fed = 0  # tokens of the request the n-gram index holds
        self.draft: list[int] = []  # proposed for the coming step (the scheduler may grant fewer)

    def propose(self, tokens: list[int], room: int) -> list[int]:
        """The draft after `tokens` (the request's known tokens), at most `room` tokens (what its
        max_tokens leaves past the next one); kept as `draft`."""
        self.ngrams.extend(tokens[self.fed :])
        self.fed = len(tokens)
        count = min(self.length.next(), room)
        self.draft = self.ngrams.draft(count) if count > 0 else []
        return self.draft

    def verified(self, drafted: int, accepted: int) -> None:
        """A decode step ran `drafted` draft tokens (0: none was granted or found), the first
        `accepted` of them chosen."""
        self.length.taken(drafted, accepted)
        self.draft = []


def engine_mode(speculate: str | None, backend, model, pool_config) -> str | None:
    """`Engine(speculate=...)` checked (RequestError naming it): None or one of ENGINE_MODES, on
    a setup where drafts give plain decoding's tokens (`refusal`)."""
    if speculate is None:
        return None
    if speculate not in ENGINE_MODES:
        raise RequestError(f"speculate must be None or one of {ENGINE_MODES}, got {speculate!r}")
    reason = refusal(backend, model, pool_config)
    if reason is not None:
        raise RequestError(f"speculate={speculate!r}: {reason}")
    return speculate


def request_mode(asked: str | None, default: str | None, backend, model, pool_config) -> str | None:
    """What one request does: its params' `speculate` ("off": nothing; None: the engine's
    `default`); RequestError naming the field where the engine cannot speculate."""
    mode = default if asked is None else None if asked == "off" else asked
    if mode is not None and asked is not None:
        reason = refusal(backend, model, pool_config)
        if reason is not None:
            raise RequestError(f"speculate={asked!r}: {reason}")
    return mode


def refusal(backend, model, pool_config) -> str | None:
    """Why this engine's drafts could change a token (None: they cannot)."""
    if not backend.chunk_invariant:
        return (f"the engine's backend {backend.name!r} sums a step of several tokens in another order "
                "than one token's (it is not chunk_invariant), so a verified draft could change a token; "
                "a GGUF loaded with activations='q8' (kvcache serve --activations q8) runs on 'blocks', "
                "which is")
    if any(window is not None for window in model.config.layer_windows):
        return "drafts are not rolled back from a sliding-window layer's blocks yet: this model has some"
    if pool_config.kv_dtype is not None or pool_config.kv_window:
        return (f"drafts are verified on a pool in the model's dtype only; this engine's has "
                f"kv_dtype={pool_config.kv_dtype!r}, kv_window={pool_config.kv_window}")
    return None


def choose_in_rounds(choose: Callable, logits, work, masks, take: Callable) -> list:
    """Choose each sampling row's tokens of the step (`work`), a position at a time: every row's
    first in one batched `choose(logits, requests, masks)` (the runner's), then the rows whose
    chosen token equals their draft's and that did not stop, at the next position, and so on.
    take(request, token, logprobs) takes each chosen token in order. Returns the (request, error)
    of rows whose sampling failed."""
    batch = work.batch
    requests, firsts, drafts = [], [], []
    at = 0
    for index in batch.sampled:
        requests.append(work.requests[index])
        firsts.append(at)
        drafts.append(work.drafts.get(work.requests[index].id, ()))
        at += batch.sample[index]
    live, depth, failures = list(range(len(requests))), 0, []
    while live:
        rows = [firsts[i] + depth for i in live]
        whole = depth == 0 and len(rows) == logits.shape[0]
        chosen, failed = choose(logits if whole else logits[rows], [requests[i] for i in live],
                                masks if depth == 0 else None)
        failures.extend(failed)
        place = {id(requests[i]): i for i in live}
        going = []
        for request, token, logprobs in chosen:
            take(request, token, logprobs)
            i = place[id(request)]
            if depth < len(drafts[i]) and token == drafts[i][depth] and request.finish is None:
                going.append(i)
        live, depth = sorted(going), depth + 1
    return failures


def propose_drafts(running: list) -> None:
    """Each decoding request of `running` that speculates proposes its draft for this step (the
    scheduler grants what fits); no draft runs past the tokens its max_tokens leaves after the
    next one, and a request that is not decoding proposes none."""
    for request in running:
        if request.speculation is not None:
            decoding = len(request.tokens) - request.cached == 1
            room = request.params.max_tokens - len(request.generated) - 1
            request.speculation.propose(request.tokens, room if decoding else 0)


def count_drafts(work, known: dict[int, int], seconds: float) -> None:
    """After the step's tokens were chosen: each decoding row that speculates gives its draft's
    verdict (drafted, accepted: the leading draft tokens equal to the chosen ones) to its draft
    length and its usage; a row that ran alone also the step's `seconds` (`DraftLength.timed`:
    what a further token of its step costs). known: each sampling request's token count before
    the step."""
    alone = len(work.requests) == 1
    for request, tokens in zip(work.requests, work.batch.tokens):
        drafts = request.speculation
        if drafts is None or len(tokens) != 1 + len(work.drafts.get(request.id, ())):
            continue
        draft = work.drafts.get(request.id, [])
        chosen = request.tokens[known.get(request.id, len(request.tokens)) :]
        accepted = 0
        while accepted < min(len(draft), len(chosen)) and draft[accepted] == chosen[accepted]:
            accepted += 1
        drafts.verified(len(draft), accepted)
        if alone:
            drafts.length.timed(len(tokens), seconds)
        request.usage.drafted_tokens += len(draft)
        request.usage.accepted_tokens += accepted
