"""The generation loop: prefill the prompt, then one decode step per token.

    result = generate(model, input_ids, attention_mask, max_new_tokens=64, cache="dynamic")
    result.sequences           # (B, T_prompt + T_new): prompt as given, then the new tokens
    result.new_tokens[row]     # the row's new tokens up to and including its stop token
    result.time_to_first_token_s, result.decode_tokens_per_s, result.backend

Two roads. On a paged cache (the default) every forward is a one-request paged step on the
backend, as the engine runs one (`paged_steps`): reserve the rows' blocks, the backend's step,
commit. On every other kind (dynamic, static, sliding, quantized, none) every forward is the
model's own torch forward through the cache seam, the reference road: it runs the tokens the
cache does not hold yet, after the prefill the newest token of each row, and for a cache that
keeps nothing (cache="none") the whole sequence again.

Batches are left-padded: row b's prompt sits at the right of input_ids[b] with zeros in the
attention mask before it. On the reference road the mask grows by a column of ones per step (as
in the Hugging Face caching guide); on a paged cache each row holds only its own tokens. Either
way every row sees exactly its own tokens and gives the tokens it gives alone.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvcache.backends import Backend, TorchBackend, choose_backend
from kvcache.backends.torch_step import last_logits
from kvcache.cache import Cache, NoCache, PagedCache, make_cache
from kvcache.generation.paged_steps import PagedSteps, RecomputedSteps, rows_tokens
from kvcache.generation.penalties import SeenTokens
from kvcache.generation.sampling import choose_tokens
from kvcache.generation.settings import GenerationSettings
from kvcache.generation.speculative import DRAFT_TOKENS, SpeculativeSteps
from kvcache.generation.stops import Stops
from kvcache.generation.structured import GrammarState, TokenTable, allowed_rows, packed_masks
from kvcache.text.eos import default_eos


@dataclass
class GenerationResult:
    """Tokens and timings of one `generate` call."""

    sequences: torch.Tensor  # (B, T_prompt + T_generated), pad_token_id after a row stopped
    new_tokens: list[list[int]]  # per row, up to and including the token that stopped it
    stop_reasons: list[str]  # per row: "eos", "stop_string" or "length"
    prompt_length: int  # T_prompt (padded width of input_ids)
    time_to_first_token_s: float = 0.0  # prefill + choosing the first token
    decode_time_s: float = 0.0  # from the first token to the last
    decode_steps: int = 0  # forwards after the prefill (tokens per row after the first)
    # what ran the forwards: a backend's name (a paged cache), "torch" for the model's forward
    # (every other kind), "none" when no decode step ran
    backend: str = "none"
    cache: Cache | None = field(default=None, repr=False)  # the cache, holding the context
    drafted_tokens: int = 0  # speculation: draft tokens verified, in all
    accepted_tokens: int = 0  # of them, the ones chosen (each a forward saved)

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second per row after the first token (batch rows run in parallel)."""
        return self.decode_steps / self.decode_time_s if self.decode_time_s > 0 else 0.0


def _unheld(ids: torch.Tensor, end: int, cache: Cache, past: int) -> torch.Tensor:
    """The tokens of ids[:, :end] the cache does not hold yet (`past`: what it held before)."""
    return ids[:, cache.get_seq_length() - past : end]


def prefill(model, input_ids, attention_mask, cache: Cache, chunk_size: int | None = None) -> torch.Tensor:
    """Run the prompt input_ids (B, T) into `cache` on the model's forward, `chunk_size` tokens at
    a time (None: all at once); return the last position's logits (B, vocab). attention_mask:
    (B, past + T) or None."""
    past = cache.get_seq_length()
    length = input_ids.shape[1]
    end = min(chunk_size or length, length)
    while True:
        mask = None if attention_mask is None else attention_mask[:, : past + end]
        logits = last_logits(model, _unheld(input_ids, end, cache, past), mask, cache)
        if end == length:
            return logits
        # a cache that kept nothing of the chunk (NoCache) would re-run it with every later
        # chunk: the rest goes in one forward
        assert chunk_size is not None
        end = length if cache.get_seq_length() - past < end else min(end + chunk_size, length)


def resolve_eos(model, eos_token_id, tokenizer=None) -> tuple[int, ...]:
    """EOS ids: the argument (an int, a list, or () for none), else the config's and tokenizer's."""
    if eos_token_id is not None:
        return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    return default_eos(model.config.eos_token_id, tokenizer)


def _cache_for(model, cache, batch_size: int, max_length: int) -> Cache:
    """`cache` as given (a Cache), or a new one of that kind (`make_cache`; None: "dynamic"),
    sized for batch_size rows of max_length tokens where the kind preallocates. A run past the
    model's context is refused before a preallocating kind is sized by it, and warned of else."""
    context = model.config.max_position_embeddings
    if max_length > context:
        message = (
            f"the prompt and max_new_tokens make {max_length:,} tokens, past the model's context of "
            f"{context:,} (max_position_embeddings)"
        )
        if cache in ("static", "paged"):
            raise ValueError(f"{message}: a {cache} cache would be sized for them; lower max_new_tokens")
        warnings.warn(f"{message}: positions past it were never trained", stacklevel=4)
    if isinstance(cache, Cache):
        return cache
    return make_cache(
        "dynamic" if cache is None else cache,
        config=model.config,
        dtype=model.dtype,
        device=model.device,
        max_batch_size=batch_size,
        max_cache_len=max_length,
    )


def stream_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    cache: Cache | str | None = "paged",
    backend: Backend | str | None = "auto",
    tokenizer=None,
    generator: torch.Generator | None = None,
    **settings,
) -> Iterator[torch.Tensor]:
    """Generate, yielding each step's (B,) tokens (pad for stopped rows); the iterator's return
    value (StopIteration.value) is the GenerationResult.

    cache: a kind of `make_cache` ("paged", the fast road; "dynamic", "static", "sliding",
        "quantized" (int8), "none": keep nothing and re-run the sequence, each on the model's
        forward) or a Cache object; None means "paged".
    backend: what runs a paged cache's steps: "auto" (the fast one where it applies), "float32",
        "half", "blocks", "torch", or a Backend (`kvcache.backends.choose_backend`); the other
        kinds run on the model's forward, and refuse any backend but "auto" and "torch".
    settings: `GenerationSettings` fields (max_new_tokens, do_sample, temperature, top_k, top_p,
        eos_token_id, pad_token_id, stop_strings, prefill_chunk_size).
    The model must not change while a call runs (its backend was built from it).
    """
    options = GenerationSettings(**settings)
    cache = "paged" if cache is None else cache
    # built once per model and kept (its weights are packed), outside the loop's inference mode;
    # like loading, not part of the time to first token
    backend = _backend_for(model, cache, backend)
    return _steps(model, input_ids, attention_mask, cache, backend, tokenizer, generator, options)


def _backend_for(model, cache, backend) -> Backend | None:
    """The backend of a paged cache's steps (`choose_backend`), or of a no-cache run's (None where
    that is the torch backend: the model's forward keeps nothing itself); None for the other
    kinds, which run on the model's forward: ValueError for a backend they would not honour."""
    if cache == "paged" or isinstance(cache, PagedCache):
        return choose_backend(model, backend)
    if cache == "none" or isinstance(cache, NoCache):  # the whole sequence again on the backend,
        chosen = choose_backend(model, backend)  # or through the model's forward
        return None if isinstance(chosen, TorchBackend) else chosen
    if backend in (None, "auto", "torch") or isinstance(backend, TorchBackend):
        return None
    kind = cache if isinstance(cache, str) else type(cache).__name__
    named = backend if isinstance(backend, str) else type(backend).__name__
    raise ValueError(f"backend {named!r} runs a paged cache's steps; cache {kind!r} runs on the model's "
                     "own forward: give cache='paged', or backend='auto' or 'torch'")


def generate(
    model,
    input_ids,
    attention_mask=None,
    *,
    streamer: Callable[[torch.Tensor], None] | None = None,
    **options,
) -> GenerationResult:
    """`stream_generate` run to the end: returns the GenerationResult. streamer: called after
    every step with that step's (B,) tokens. Every other argument is stream_generate's."""
    steps = stream_generate(model, input_ids, attention_mask, **options)
    while True:
        try:
            tokens = next(steps)
        except StopIteration as done:
            return done.value
        if streamer is not None:
            streamer(tokens)


@torch.inference_mode()
def _steps(
    model, input_ids, attention_mask, cache, backend, tokenizer, generator, options: GenerationSettings
):
    started = time.perf_counter()
    input_ids, attention_mask = _check_inputs(model, input_ids, attention_mask)
    eos_ids, pad_token_id = _stop_ids(model, options, tokenizer)
    batch, prompt_length = input_ids.shape
    cache = _cache_for(model, cache, batch, prompt_length + options.max_new_tokens)
    if attention_mask is not None and bool(attention_mask.all()):
        attention_mask = None  # no padding: positions and masks follow from the cache alone
    forwards = _Forwards(model, backend, cache, batch, attention_mask, options)
    try:  # all or nothing: a call that fails leaves a supplied cache as it was
        ids = input_ids.new_empty((batch, prompt_length + options.max_new_tokens))  # (B, T_prompt + new)
        ids[:, :prompt_length] = input_ids
        stops = Stops(batch, eos_ids, pad_token_id, options.stop_strings, tokenizer,
                      _grammars(model, options.structured, tokenizer, eos_ids, batch))
        sampling = [options.sampling] * batch
        seen = _seen_tokens(input_ids, attention_mask) if options.sampling.penalizes else None
        logits = forwards.prefill(input_ids, options.prefill_chunk_size)
        first_token_at = decode_started = time.perf_counter()
        decode_steps = 0
        for step in range(options.max_new_tokens):
            end = prompt_length + step  # tokens in ids so far
            if step > 0:
                logits = forwards.decode(ids, end)
                decode_steps += 1
            tokens = _choose(logits, sampling, generator, seen, stops).to(ids.device)  # (B,)
            if step == 0:
                first_token_at = decode_started = time.perf_counter()
            ids[:, end] = tokens
            yield tokens
            if stops.all_done:
                end += 1
                break
        else:
            end = prompt_length + options.max_new_tokens
        forwards.finish()
    except GeneratorExit:  # the caller stopped reading: what ran stays in the cache
        forwards.finish()
        raise
    except BaseException:
        forwards.undo()
        raise
    finished_at = time.perf_counter()
    with torch.inference_mode(False):  # a normal tensor: usable in any later forward, with grad too
        sequences = ids[:, :end].clone()
    return GenerationResult(
        sequences=sequences,
        new_tokens=stops.new_tokens,
        stop_reasons=stops.reasons,
        prompt_length=prompt_length,
        time_to_first_token_s=first_token_at - started,
        decode_time_s=finished_at - decode_started if decode_steps else 0.0,
        decode_steps=decode_steps,
        backend=forwards.ran if decode_steps else "none",
        cache=cache,
        **forwards.drafts(),
    )


class _Forwards:
    """One call's forwards on its road: a paged cache's steps on the backend (`PagedSteps`; no
    cache on a backend: `RecomputedSteps`), or the model's forward through any other cache (the
    mask grown a column per step)."""

    def __init__(self, model, backend: Backend | None, cache: Cache, batch: int, attention_mask,
                 options: GenerationSettings) -> None:
        self.model, self.cache, self.attention_mask = model, cache, attention_mask
        self.past = cache.get_seq_length()  # what a supplied cache holds already
        self.paged: PagedSteps | RecomputedSteps | SpeculativeSteps | None = None
        if options.speculate is not None and not isinstance(cache, PagedCache):
            raise ValueError(f"speculate verifies drafts in a paged cache's steps; cache "
                             f"{type(cache).__name__} runs on the model's own forward: give cache='paged'")
        if isinstance(cache, PagedCache):
            self.paged = PagedSteps(model, backend, cache, batch)
            if options.speculate is not None:
                self.paged = SpeculativeSteps(self.paged, _draft_tokens(model, backend, batch, options),
                                              options.max_new_tokens)
        elif backend is not None:  # (a cache that keeps nothing, on a backend)
            self.paged = RecomputedSteps(model, backend)
        self.ran = "torch" if backend is None else backend.name

    def prefill(self, input_ids: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
        """(B, vocab) logits of the prompt's last position after running it."""
        if self.paged is not None:
            return self.paged.prefill(rows_tokens(input_ids, self.attention_mask), chunk_size)
        return prefill(self.model, input_ids, self.attention_mask, self.cache, chunk_size)

    def decode(self, ids: torch.Tensor, end: int) -> torch.Tensor:
        """(B, vocab) logits after running what the cache lacks of ids[:, :end] (the newest token
        of each row; for a cache that keeps nothing, everything)."""
        if self.paged is not None:
            return self.paged.decode(ids[:, end - 1])
        mask = self.attention_mask
        if mask is not None:
            mask = self.attention_mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], 1)
        return last_logits(self.model, _unheld(ids, end, self.cache, self.past), mask, self.cache)

    def finish(self) -> None:
        """The call ended: a speculative road's unconfirmed draft tokens trimmed from the cache."""
        if isinstance(self.paged, SpeculativeSteps):
            self.paged.finish()

    def drafts(self) -> dict:
        """The result's `drafted_tokens` and `accepted_tokens` (0 without speculation)."""
        if not isinstance(self.paged, SpeculativeSteps):
            return {}
        return {"drafted_tokens": self.paged.drafted_total, "accepted_tokens": self.paged.accepted_total}

    def undo(self) -> None:
        """A failed call: the cache back to what it held before."""
        if self.paged is not None:
            self.paged.undo()
        else:
            self.cache.abandon_forward(self.past)


def _draft_tokens(model, backend: Backend, batch: int, options: GenerationSettings) -> int:
    """The most tokens a draft may hold on `backend` (`GenerationSettings.draft_tokens`, checked):
    ValueError where speculation would not give the tokens plain decoding gives."""
    if batch != 1:
        raise ValueError(f"speculate drafts for one row; input_ids has {batch}")
    if not backend.chunk_invariant:
        raise ValueError(
            f"speculate needs a backend whose step gives a token the logits it gets alone (chunk_invariant); "
            f"backend {backend.name!r} sums a step of several tokens in another order, so a verified draft "
            "could change a token (a GGUF loaded with q8 activations, the default, runs on 'blocks', which "
            "does)")
    if any(window is not None for window in model.config.layer_windows):
        raise ValueError("speculate does not roll back a sliding-window layer's blocks yet: this model has "
                         "windowed layers")
    return options.draft_tokens or DRAFT_TOKENS


def _choose(logits, sampling, generator, seen: list[SeenTokens] | None, stops: Stops) -> torch.Tensor:
    """The step's (B,) tokens (pad for stopped rows), noted in `seen` for the next step's penalties."""
    allowed = None
    if stops.grammars is not None:  # the rows still running: their grammars' masks
        running = [grammar for grammar, done in zip(stops.grammars, stops.finished) if not done]
        masks = iter(allowed_rows(packed_masks(running, running[0].table.words), logits.shape[-1]))
        allowed = [None if done else next(masks) for done in stops.finished]
    tokens = stops.take(choose_tokens(logits, sampling, shared=generator, seen=seen, allowed=allowed))
    for row, token in zip(seen or (), tokens.tolist()):
        row.tokens.append(token)
    return tokens


def _grammars(model, structured, tokenizer, eos_ids, batch: int) -> list | None:
    """Each row's GrammarState of `structured` (None: no structured output)."""
    if structured is None:
        return None
    if tokenizer is None:
        raise ValueError("structured outputs need the tokenizer (generate's tokenizer=...)")
    ends = tuple(dict.fromkeys(eos_ids or model.config.eos_token_id))  # (no EOS asked: the model's)
    table = TokenTable(tokenizer, model.config.vocab_size, ends)
    return [GrammarState(structured, table) for _ in range(batch)]


def _seen_tokens(input_ids: torch.Tensor, attention_mask) -> list[SeenTokens]:
    """Each row's prompt (its padding left out) as the SeenTokens its penalties read."""
    rows = []
    for row in range(input_ids.shape[0]):
        prompt = input_ids[row]
        if attention_mask is not None:  # (B, held + T): the last T columns are the prompt's
            prompt = prompt[attention_mask[row, -input_ids.shape[1] :] == 1]
        tokens = prompt.tolist()
        rows.append(SeenTokens(tokens, len(tokens)))
    return rows


def _stop_ids(model, options: GenerationSettings, tokenizer) -> tuple[tuple[int, ...], int]:
    """(the EOS ids a row stops at, the id a stopped row is padded with), checked; ValueError for
    stop strings without a tokenizer to read them, or a pad id outside the vocabulary."""
    if options.stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to read the generated text")
    eos_ids = resolve_eos(model, options.eos_token_id, tokenizer)
    pad_token_id = options.pad_token_id
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids else getattr(tokenizer, "pad_token_id", None) or 0
    vocab = model.config.vocab_size
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or not 0 <= pad_token_id < vocab:
        raise ValueError(f"pad_token_id must be a token id in [0, {vocab}), got {pad_token_id!r}")
    return eos_ids, pad_token_id


def _check_inputs(model, input_ids, attention_mask):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise ValueError("input_ids must be a (batch, tokens) or (tokens,) tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no tokens: the prompt must have at least one")
    if input_ids.dtype == torch.bool or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= model.config.vocab_size:
        raise ValueError(
            f"input_ids must lie in [0, {model.config.vocab_size}), got min "
            f"{int(input_ids.min())} and max {int(input_ids.max())}"
        )
    input_ids = input_ids.to(model.device)
    if attention_mask is not None:
        given = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else None
        rows, tokens = input_ids.shape
        if given is None or len(given) != 2 or given[0] != rows or given[1] < tokens:
            raise ValueError(
                f"attention_mask must be a (batch={rows}, held + {tokens} tokens) tensor, got "
                f"{given if given is not None else type(attention_mask).__name__}"
            )
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError(
                f"attention_mask must hold 1 (token) and 0 (padding) only, got values "
                f"{sorted(set(attention_mask.flatten().tolist()))[:8]}"
            )
        attention_mask = attention_mask.to(model.device)
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "the last prompt position is padding in some row: pad on the left "
                "(tokenizer.padding_side = 'left') so every row ends with its last token"
            )
    return input_ids, attention_mask
