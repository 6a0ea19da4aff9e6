"""The generation loop: prefill the prompt (whole or in chunks), then one decode step per token.

    result = generate(model, input_ids, attention_mask, max_new_tokens=64, cache="dynamic")
    result.sequences           # (B, T_prompt + T_new): prompt as given, then the new tokens
    result.new_tokens[row]     # the row's new tokens up to and including its stop token
    result.time_to_first_token_s, result.decode_tokens_per_s

Batches are left-padded: row b's prompt sits at the right of input_ids[b] with zeros in the
attention mask before it. The mask grows by a column of ones per step (as in the Hugging Face
caching guide), so every row sees exactly its own tokens and gives the tokens it gives alone.
`cache=None` is the no-cache path: every step re-runs the whole sequence, kept for checking.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvcache.generation.sampling import SamplingSettings, choose_next
from kvcache.model.kernels import torch_threads
from kvcache.model.llama import no_cache

# "quantized" is int8 with make_cache's defaults (lossy: its tokens may differ); pass a
# QuantizedCache object for other settings.
CACHE_KINDS = ("dynamic", "static", "sliding", "paged", "quantized")


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
    cache: object | None = field(default=None, repr=False)  # the cache, holding the context

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens per second per row after the first token (batch rows run in parallel)."""
        return self.decode_steps / self.decode_time_s if self.decode_time_s > 0 else 0.0


def resolve_eos(model, eos_token_id, tokenizer=None) -> tuple[int, ...]:
    """EOS ids: the argument (an int, a list, or () for none), else the config's and tokenizer's."""
    if eos_token_id is not None:
        return (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    ids = list(getattr(model.config, "eos_token_id", ()) or ())
    tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
    if tokenizer_eos is not None and tokenizer_eos not in ids:
        ids.append(tokenizer_eos)
    return tuple(ids)


def build_cache(model, kind, batch_size: int, max_length: int):
    """A cache for `kind` (one of CACHE_KINDS | None | a cache object), sized for batch_size
    rows of max_length tokens where the kind preallocates."""
    from kvcache.cache import make_cache

    if kind is None or kind == "none":
        return None
    if not isinstance(kind, str):
        return kind  # a cache object supplied by the caller
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache must be one of {CACHE_KINDS}, None, or a Cache object; got {kind!r}")
    options: dict = {"config": model.config, "dtype": model.dtype, "device": model.device}
    if kind in ("static", "sliding", "paged"):
        options.update(max_batch_size=batch_size, max_cache_len=max_length)
    if kind == "sliding" and model.config.sliding_window is None:
        raise ValueError(
            "cache='sliding' needs a model whose config has a sliding_window (mistral, qwen2 "
            "with use_sliding_window); this model attends to the whole context, so a window "
            "would change its output. Pass a SlidingWindowCache object to do it on purpose."
        )
    return make_cache(kind, **options)


def generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 32,
    cache="dynamic",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer=None,
    prefill_chunk_size: int | None = None,
    streamer: Callable[[torch.Tensor], None] | None = None,
) -> GenerationResult:
    """Generate up to `max_new_tokens` per row; greedy unless do_sample=True.

    cache: "dynamic" | "static" | "sliding" | "paged" | "quantized" (int8) | a cache object |
        None (no cache: recompute).
    eos_token_id: None = the model config's (and tokenizer's) EOS ids; () = never stop early.
    stop_strings: stop a row once its new text contains one (needs `tokenizer`).
    prefill_chunk_size: run the prompt through the model this many tokens at a time.
    streamer: called after every step with that step's (B,) tokens (pad for stopped rows).

    A model changed during the call (weights replaced, moved or written, hooks registered) is
    seen from the next step when the change is made by the streamer (or, for
    `stream_generate`, between steps). A change made elsewhere meanwhile (another thread, a
    cache's or tokenizer's own methods) may be seen only from the next call: the numpy decode
    step checks its weight views at the first decode step and after those places only.
    """
    options = dict(locals())  # the arguments, passed on as they are
    del options["streamer"]
    steps = _generation_steps(**options, caller_runs_between_steps=streamer is not None)
    while True:
        try:
            tokens = next(steps)
        except StopIteration as done:
            return done.value
        if streamer is not None:
            streamer(tokens)


def stream_generate(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 32,
    cache="dynamic",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop_strings: Sequence[str] | None = None,
    tokenizer=None,
    prefill_chunk_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Like `generate`, as an iterator of (B,) tokens per step; its return value (the
    StopIteration value) is the GenerationResult."""
    return _generation_steps(**locals(), caller_runs_between_steps=True)


@torch.inference_mode()
def _generation_steps(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    max_new_tokens: int,
    cache,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
    eos_token_id: int | Sequence[int] | None,
    pad_token_id: int | None,
    stop_strings: Sequence[str] | None,
    tokenizer,
    prefill_chunk_size: int | None,
    caller_runs_between_steps: bool,
) -> Iterator[torch.Tensor]:
    """The loop behind `generate` and `stream_generate`. caller_runs_between_steps: whether
    the caller's code (a streamer, the iterator's consumer) runs between steps, where it may
    change the model; if not, the numpy decode step checks its weight views at the first
    decode step only (`model.decode_logits(check=...)`; see `generate`)."""
    started = time.perf_counter()
    settings = SamplingSettings(do_sample, temperature, top_k, top_p)
    input_ids, attention_mask = _check_inputs(model, input_ids, attention_mask, max_new_tokens)
    if prefill_chunk_size is not None and prefill_chunk_size < 1:
        raise ValueError(f"prefill_chunk_size must be >= 1 or None, got {prefill_chunk_size}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need a tokenizer to read the generated text")
    eos_ids = resolve_eos(model, eos_token_id, tokenizer)
    if pad_token_id is None:
        pad_token_id = eos_ids[0] if eos_ids else getattr(tokenizer, "pad_token_id", None) or 0
    batch, prompt_length = input_ids.shape
    cache = build_cache(model, cache, batch, prompt_length + max_new_tokens)
    past = 0 if cache is None else cache.get_seq_length()
    if attention_mask is None:
        attention_mask = input_ids.new_ones((batch, past + prompt_length))
    # without padding, positions and masks follow from the cache length alone: decode steps
    # then pass no mask (no per-step concatenation and cumulative sum)
    padded = not bool(attention_mask.all())

    eos_set = {int(token) for token in eos_ids}  # ints (ids given as 0-d tensors hash by identity)
    finished = [False] * batch  # per row: stopped (EOS or stop string); kept as Python bools
    reasons = ["length"] * batch
    new_tokens: list[list[int]] = [[] for _ in range(batch)]
    generated: list[torch.Tensor] = []
    sequence = input_ids  # grows only on the no-cache path, which re-reads it every step

    # unpadded decode steps go straight to the model's numpy step when it has one (no module
    # call overhead); it declines (None) where it does not apply, and then the model runs
    # (looked up on the class: a wrapper that forwards attribute lookups, such as a compiled
    # module, is called as a module, with its own forward and hooks)
    direct = cache is not None and not padded and callable(getattr(type(model), "decode_logits", None))
    check_views = True  # the numpy step's views are checked at the first decode step

    logits = _prefill(model, input_ids, attention_mask, cache, prefill_chunk_size)
    first_token_at = decode_started = time.perf_counter()
    decode_steps = 0
    for step in range(max_new_tokens):
        if step > 0:
            if padded:
                attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], 1)
            step_mask = attention_mask if padded else None
            if cache is None:  # the whole sequence again: matrix-matrix work, the caller's threads
                sequence = torch.cat([sequence, generated[-1][:, None]], dim=1)
                logits = _forward_last(model, sequence, step_mask, None)
            else:
                with torch_threads(getattr(model, "decode_threads", None)):
                    logits = None
                    if direct:
                        logits = model.decode_logits(generated[-1][:, None], cache, check=check_views)
                        direct = logits is not None  # declined: the model's forward from now on
                        check_views = caller_runs_between_steps
                    if logits is None:
                        logits = _forward_last(model, generated[-1][:, None], step_mask, cache)
            decode_steps += 1
        next_ids = choose_next(logits, settings, generator)  # (B,) long
        chosen = next_ids.tolist()
        if any(finished):  # stopped rows get the pad token
            row_tokens = [pad_token_id if done else token for token, done in zip(chosen, finished)]
            tokens = torch.tensor(row_tokens, dtype=torch.long, device=input_ids.device)  # (B,)
        else:
            row_tokens, tokens = chosen, next_ids.to(input_ids.device)  # no copy on one device
        if step == 0:
            first_token_at = decode_started = time.perf_counter()
        generated.append(tokens)
        for row, token in enumerate(row_tokens):
            if finished[row]:
                continue
            new_tokens[row].append(token)
            if token in eos_set:
                reasons[row], finished[row] = "eos", True
            elif stop_strings and _ends_with_stop(tokenizer, new_tokens[row], stop_strings):
                reasons[row], finished[row] = "stop_string", True
        yield tokens
        if all(finished):
            break
    finished_at = time.perf_counter()

    sequences = torch.cat([input_ids, torch.stack(generated, dim=1)], dim=1)
    return GenerationResult(
        sequences=sequences,
        new_tokens=new_tokens,
        stop_reasons=reasons,
        prompt_length=prompt_length,
        time_to_first_token_s=first_token_at - started,
        decode_time_s=finished_at - decode_started if decode_steps else 0.0,
        decode_steps=decode_steps,
        cache=cache,
    )


def _check_inputs(model, input_ids, attention_mask, max_new_tokens):
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() not in (1, 2):
        raise ValueError("input_ids must be a (batch, tokens) or (tokens,) tensor of token ids")
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
        attention_mask = None if attention_mask is None else attention_mask.reshape(1, -1)
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids holds no tokens: the prompt must have at least one")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= model.config.vocab_size:
        raise ValueError(
            f"input_ids must lie in [0, {model.config.vocab_size}), got min "
            f"{int(input_ids.min())} and max {int(input_ids.max())}"
        )
    input_ids = input_ids.to(model.device)
    if attention_mask is not None:
        attention_mask = attention_mask.to(model.device)
        if bool((attention_mask[:, -1] == 0).any()):
            raise ValueError(
                "the last prompt position is padding in some row: pad on the left "
                "(tokenizer.padding_side = 'left') so every row ends with its last token"
            )
    return input_ids, attention_mask


def _forward_last(model, input_ids, attention_mask, cache) -> torch.Tensor:
    """(B, vocab) float logits of the last position after running input_ids."""
    if cache is None:
        cache = no_cache(model.config)
    out = model(
        input_ids,
        attention_mask=attention_mask,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


def _prefill(model, input_ids, attention_mask, cache, chunk_size) -> torch.Tensor:
    """Run the prompt (in chunks of chunk_size if given); return the last position's logits."""
    prompt_length = input_ids.shape[1]
    if cache is None or chunk_size is None or chunk_size >= prompt_length:
        return _forward_last(model, input_ids, attention_mask, cache)
    past = attention_mask.shape[1] - prompt_length  # tokens already in a supplied cache
    logits = None
    for start in range(0, prompt_length, chunk_size):
        end = min(start + chunk_size, prompt_length)
        logits = _forward_last(model, input_ids[:, start:end], attention_mask[:, : past + end], cache)
    return logits


def _ends_with_stop(tokenizer, tokens: list[int], stop_strings: Sequence[str]) -> bool:
    """Whether the text of the newest tokens contains a stop string (checked every step)."""
    longest = max(len(stop) for stop in stop_strings)
    text = tokenizer.decode(tokens[-(longest + 8) :])  # enough tokens to spell any stop string
    return any(stop in text for stop in stop_strings)
