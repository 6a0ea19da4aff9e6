"""The report's engine parts (torch): decode-step latency vs context with and without the cache,
equality of every exact cache kind with recomputation, and drift of the quantized caches.

Latency is measured (medians with min–max); equality and drift are computed on the model and are
the same on every run on one machine.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from kvcache.cache import CacheConfigError, make_cache

Progress = Callable[[float, str], None]

# Tolerance of "the same logits" for a float32 model (docs: DESIGN, fp32 atol 1e-5), per logit:
# |cached − recomputed| <= EQUALITY_ATOL + EQUALITY_RTOL · |recomputed|.
EQUALITY_ATOL = 1e-5
EQUALITY_RTOL = 1e-5

# Prompts for the drift and equality runs: long enough that most of a quantized cache is packed
# (residual 32 + group 32 < prompt length). Written for this report.
PROMPTS = (
    "A dictionary maps keys to values. Any hashable object can be a key: numbers, strings and "
    "tuples that hold only hashable items. Looking up a key that is not present raises KeyError, "
    "so code that is not sure a key exists calls the get method, which returns a default instead. "
    "Iterating over a dictionary yields its keys in the order they were first inserted, and the "
    "items method yields pairs of keys and values.",
    "def read_lines(path, encoding='utf-8'):\n"
    '    """Return the lines of the file at path without their line endings."""\n'
    "    with open(path, encoding=encoding) as handle:\n"
    "        return [line.rstrip('\\n') for line in handle]\n\n\n"
    "def count_words(lines):\n"
    '    """Return a dictionary mapping each word to the number of times it occurs."""\n'
    "    counts = {}\n    for line in lines:\n        for word in line.split():\n",
    "<|user|>\nWhy does a generator function use yield instead of return, and what happens to its "
    "local variables between two calls to next?<|end|>\n<|assistant|>\nA generator function does "
    "not run when it is called. It returns a generator object, and each call to next runs the body",
)


def _spread(samples_s: Sequence[float]) -> dict:
    """Median, min and max of timings in seconds, as milliseconds."""
    ms = [s * 1e3 for s in samples_s]
    return {"median": statistics.median(ms), "min": min(ms), "max": max(ms), "samples": ms}


@torch.inference_mode()
def latency_figures(model, lengths: Sequence[int], repeats: int, seed: int = 0,
                    progress: Progress | None = None) -> dict:
    """One decode step's wall time at each context length L, with and without the cache.

    Cached: the cache holds L − 1 tokens (one prefill), the step runs token L; the cache is
    cropped back to L − 1 before each repeat. Uncached: the step recomputes all L positions
    (no cache kept), logits of the last only. The two paths alternate, repeat by repeat, so a
    busy spell hits both; one untimed warm-up step each first. Token ids are seeded random ones.
    """
    say = progress or (lambda fraction, label: None)
    limit = model.config.max_position_embeddings
    usable = sorted({length for length in lengths if 2 <= length <= limit})
    if not usable:
        raise ValueError(f"no context length in {list(lengths)} is within 2..{limit}")
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (1, usable[-1]), generator=generator)
    rows = []
    for index, length in enumerate(usable):
        say(index / len(usable), f"latency: context {length}")
        # one spare ring row per sliding layer, so crop(L - 1) can undo the timed step
        cache = make_cache("dynamic", config=model.config, device=model.device, max_rollback=1)
        model(ids[:, : length - 1], past_key_values=cache, use_cache=True, logits_to_keep=1)
        last = ids[:, length - 1: length]
        cached, uncached = [], []
        for repeat in range(repeats + 1):
            cache.crop(length - 1)
            start = time.perf_counter()
            model(last, past_key_values=cache, use_cache=True)
            elapsed_cached = time.perf_counter() - start
            start = time.perf_counter()
            model(ids[:, :length], use_cache=False, logits_to_keep=1)
            elapsed_uncached = time.perf_counter() - start
            if repeat:  # repeat 0 is the warm-up
                cached.append(elapsed_cached)
                uncached.append(elapsed_uncached)
        row = {"context": length, "cached_ms": _spread(cached), "uncached_ms": _spread(uncached)}
        row["speedup"] = row["uncached_ms"]["median"] / row["cached_ms"]["median"]
        rows.append(row)
    say(1.0, "latency: done")
    skipped = sorted(set(lengths) - set(usable))
    return {"repeats": repeats, "threads": torch.get_num_threads(), "dtype": str(model.dtype),
            "backend": "torch", "skipped_lengths": skipped, "rows": rows}


def _windowed(config, window: int):
    """The model's config with every layer attending to the last `window` positions only (a
    mistral-family config: a llama config's window is not in force)."""
    return dataclasses.replace(config, model_type="mistral", sliding_window=window,
                               layer_types=("sliding_attention",) * config.num_hidden_layers)


def _cached_logits(model, prompt: torch.Tensor, cache, steps: int) -> tuple[list[int], torch.Tensor]:
    """Prefill `prompt` (1, T) into `cache`, then `steps` greedy decode steps: the tokens chosen
    and the (steps, vocab) logits each was chosen from."""
    logits = model(prompt, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[0, -1]
    tokens, rows = [], []
    for step in range(steps):
        rows.append(logits.float())
        tokens.append(int(logits.argmax()))
        if step + 1 < steps:
            feed = torch.tensor([[tokens[-1]]], device=prompt.device)
            logits = model(feed, past_key_values=cache, use_cache=True).logits[0, -1]
    return tokens, torch.stack(rows)


@torch.inference_mode()
def equality_figures(model, prompt_ids: Sequence[int], new_tokens: int, window: int, block_size: int,
                     progress: Progress | None = None) -> dict:
    """Max |Δlogit| between each exact cache kind and recomputing the whole sequence.

    Each kind decodes `new_tokens` greedy tokens after the prompt; the reference is one forward
    of prompt + those tokens without a cache, whose logits at every position are what a step
    without a cache computes. Sliding-window kinds run the model with every layer windowed at
    `window` (the reference windows its masks the same way), so their ring wraps. Lengths cross
    the window, every `block_size`, and (full runs) the dynamic buffer's first growth at 256.
    A kind the model's config rules out (paged with sliding layers) is a row with "skipped": why.
    """
    say = progress or (lambda fraction, label: None)
    config = model.config
    window = config.sliding_window or window  # a model with a window of its own is checked at it
    windowed = _windowed(config, window)
    prompt = torch.tensor([list(prompt_ids)], device=model.device)
    total = prompt.shape[1] + new_tokens
    kinds = [
        ("dynamic", "grows ×1.5 in steps of 256 rows", config,
         lambda: make_cache("dynamic", config=config, device=model.device)),
        ("static", f"preallocated {total} rows", config,
         lambda: make_cache("static", config=config, max_cache_len=total, max_batch_size=1,
                            dtype=model.dtype, device=model.device)),
        ("paged", f"blocks of {block_size} tokens", config,
         lambda: make_cache("paged", config=config, max_cache_len=total, block_size=block_size,
                            dtype=model.dtype, device=model.device)),
        ("sliding", f"ring of {window} rows, every layer windowed", windowed,
         lambda: make_cache("sliding", config=windowed, window=window, device=model.device)),
        ("dynamic, windowed layers", f"sliding layers of a dynamic cache: ring of {window}", windowed,
         lambda: make_cache("dynamic", config=windowed, device=model.device)),
    ]
    rows = []
    for index, (kind, storage, kind_config, build) in enumerate(kinds):
        say(index / len(kinds), f"equality: {kind}")
        window_used = window if kind_config is windowed else None
        try:
            cache = build()
        except CacheConfigError as error:  # e.g. paged on a model with sliding layers
            rows.append({"kind": kind, "storage": storage, "window": window_used, "skipped": str(error)})
            continue
        tokens, logits = _cached_logits(model, prompt, cache, new_tokens)
        sequence = torch.cat([prompt[0], torch.tensor(tokens[:-1], device=prompt.device)])[None]
        reference = model(sequence, past_key_values=make_cache("none", config=kind_config),
                          use_cache=True).logits[0, prompt.shape[1] - 1:].float()  # (steps, vocab)
        diff = (logits - reference).abs()
        # scaled by each step's largest logit: float rounding grows with the logits' magnitude,
        # so a near-zero logit of a real model must not be held to a bare absolute tolerance
        allowed = EQUALITY_ATOL + EQUALITY_RTOL * reference.abs().amax(-1, keepdim=True)  # (steps, 1)
        within = bool((diff <= allowed).all())
        rows.append({
            "kind": kind,
            "storage": storage,
            "window": window_used,
            "max_abs_logit_diff": float(diff.max()),
            "max_abs_logit": float(reference.abs().max()),
            "tolerance_used": float((diff / allowed).max()),  # worst logit: |Δ| / its tolerance
            "same_argmax": bool((reference.argmax(-1) == logits.argmax(-1)).all()),
            "within": within,
        })
    say(1.0, "equality: done")
    return {"tolerance": {"atol": EQUALITY_ATOL, "rtol": EQUALITY_RTOL}, "dtype": str(model.dtype),
            "prompt_tokens": prompt.shape[1], "new_tokens": new_tokens, "rows": rows}


def drift_figures(model, prompts: Sequence[Sequence[int]], bits: Sequence[int | str], tokens: int,
                  group_size: int, residual: int, progress: Progress | None = None) -> dict:
    """`kvcache.report.drift.measure_drift` for each setting: rows of `DriftResult.to_dict()`
    (setting, max |Δlogit|, mean KL, greedy agreement, bytes per token, within_tolerance)."""
    from kvcache.report.drift import DriftSetting, Tolerance, measure_drift

    say = progress or (lambda fraction, label: None)
    settings = [DriftSetting(b, group_size, residual) for b in bits]
    runs = len(prompts) * (1 + 2 * len(settings))  # reference + free (+ teacher-forced) per setting
    done = 0

    def line(text: str) -> None:
        nonlocal done
        done += 1
        say(min(done / runs, 0.99), f"drift: {text.strip()}")

    tolerance = Tolerance()
    results = measure_drift(model, [torch.tensor(p) for p in prompts], settings, tokens=tokens,
                            tolerance=tolerance, progress=line)
    rows = []
    for result in results:
        row = result.to_dict()
        row["name"] = "fp8" if result.setting.kind == "fp8" else f"int{result.setting.bits}"
        rows.append(row)
    say(1.0, "drift: done")
    return {"tolerance": dataclasses.asdict(tolerance), "tokens": tokens, "prompts": len(prompts),
            "prompt_tokens": [len(p) for p in prompts], "dtype": str(model.dtype), "rows": rows}
