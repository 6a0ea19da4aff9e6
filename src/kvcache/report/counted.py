"""The report's counted parts (standard library only): multiplications with and without the
cache against the closed forms, the reference's rounding experiment in bits, and KV memory for
the default model and a few public architectures. Deterministic: the same figures on any machine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from kvcache.memory import KVShape, max_sequences, max_tokens
from kvcache.reference import formulas
from kvcache.reference.compare import allclose, max_abs_diff
from kvcache.reference.randoms import random_problem
from kvcache.reference.single_head import generate_cached, generate_nocache
from kvcache.reference.tables import mul_table

# The reference's own tolerance (float64 lists; `kvcache lab` uses the same).
REFERENCE_RTOL = 1e-9
REFERENCE_ATOL = 1e-12

# Significant bits of the floating formats, marked on the rounding plot (sign and exponent aside).
FORMAT_BITS = {"fp8 e4m3": 4, "bf16": 8, "fp16": 11, "fp32": 24}

# Public architectures by the fields of their published Hugging Face config.json (repository in
# `source`). KVShape.from_config reads them as it reads any config: head_dim = hidden_size /
# num_attention_heads; Mistral-7B-v0.1 windows every layer at 4,096 tokens; Qwen2-7B ships
# sliding_window with use_sliding_window false, so no layer is windowed.
ARCHITECTURES: tuple[tuple[str, str, dict], ...] = (
    ("Llama-2-7B", "meta-llama/Llama-2-7b-hf",
     {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096}),
    ("Llama-3-8B", "meta-llama/Meta-Llama-3-8B",
     {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}),
    ("Mistral-7B-v0.1", "mistralai/Mistral-7B-v0.1",
     {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
      "sliding_window": 4096}),
    ("Qwen2-7B", "Qwen/Qwen2-7B",
     {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
      "sliding_window": 131072, "use_sliding_window": False}),
)

_CLOSED_FORMS: dict[str, Callable[[int, int], int]] = {
    "nocache_total": formulas.single_head_nocache_total,
    "cached_total": formulas.single_head_cached_total,
    "nocache_per_token": formulas.single_head_nocache_step,
    "cached_per_token": formulas.single_head_cached_step,
}


def count_figures(lengths: Sequence[int], d: int, seed: int = 0) -> dict:
    """The counted table (`mul_table`) with each count's closed form beside it.

    Returns {"d", "rows", "closed_forms", "matches_closed_forms"}: rows as `mul_table` gives them,
    closed_forms one row per length of the same keys computed from `kvcache.reference.formulas`
    (plus the projection split: 3·t·d² without the cache, 3·d² with it), and whether every
    counted figure equals its closed form.
    """
    rows = mul_table(lengths, d, seed)
    closed = []
    for row in rows:
        n = row["length"]
        forms = {key: form(n, d) for key, form in _CLOSED_FORMS.items()}
        forms["nocache_projection_per_token"] = 3 * n * d * d
        forms["cached_projection_per_token"] = 3 * d * d
        forms["nocache_attention_per_token"] = forms["nocache_per_token"] - 3 * n * d * d
        forms["cached_attention_per_token"] = forms["cached_per_token"] - 3 * d * d
        closed.append({"length": n, **forms})
    matches = all(row[key] == form[key] for row, form in zip(rows, closed) for key in form)
    return {"d": d, "rows": rows, "closed_forms": closed, "matches_closed_forms": matches}


def round_to_bits(value: float, bits: int) -> float:
    """`value` rounded to `bits` significant bits (what a float format with a `bits`-bit
    significand keeps, exponent range aside); 0, inf and nan unchanged."""
    if value == 0.0 or not math.isfinite(value):
        return value
    mantissa, exponent = math.frexp(value)  # value = mantissa · 2**exponent, 0.5 <= |mantissa| < 1
    return math.ldexp(round(mantissa * 2.0**bits), exponent - bits)


def rounding_figures(bits: Sequence[int], tokens: int, d: int, seed: int = 0) -> dict:
    """The reference's low-precision experiment in bits: k and v written into the cache rounded
    to b significant bits, outputs compared with the exact (no-cache) ones.

    Returns {"d", "tokens", "tolerance", "format_bits", "rows"}; a row is {"bits",
    "max_abs_diff", "within"} against |a − b| ≤ atol + rtol·|b|.
    """
    xs, Wq, Wk, Wv = random_problem(d, tokens, seed)
    exact = generate_nocache(xs, Wq, Wk, Wv)
    rows = []
    for b in sorted(set(bits)):
        out = generate_cached(xs, Wq, Wk, Wv, store=lambda a, b=b: round_to_bits(a, b))
        rows.append({"bits": b, "max_abs_diff": max_abs_diff(out, exact),
                     "within": allclose(out, exact, REFERENCE_RTOL, REFERENCE_ATOL)})
    return {"d": d, "tokens": tokens, "tolerance": {"rtol": REFERENCE_RTOL, "atol": REFERENCE_ATOL},
            "format_bits": dict(FORMAT_BITS), "rows": rows}


def _model_memory(name: str, source: str, shape: KVShape, lengths: Sequence[int], dtypes: Sequence[str],
                  budget_bytes: int, capacity_tokens: int, fields: Mapping | None = None) -> dict:
    capacity = {
        dtype: {
            "max_tokens_batch_1": max_tokens(shape, budget_bytes, 1, dtype),
            "max_sequences": max_sequences(shape, budget_bytes, capacity_tokens, dtype),
        }
        for dtype in dtypes
    }
    return {
        "name": name,
        "source": source,
        "config_fields": dict(fields) if fields is not None else None,
        "layers": shape.layers,
        "kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "sliding_window": shape.sliding_window,
        "bytes_per_token": {dtype: shape.bytes_per_token(dtype) for dtype in dtypes},
        "rows": [{"tokens": t, **{dtype: shape.bytes(t, 1, dtype) for dtype in dtypes}} for t in lengths],
        "capacity": capacity,
    }


def memory_figures(default_shape: KVShape, default_name: str, lengths: Sequence[int],
                   dtypes: Sequence[str], budget_bytes: int, capacity_tokens: int) -> dict:
    """KV bytes vs context (batch 1) in each dtype, and capacity in `budget_bytes`, for the
    model the report ran on (`default_shape`, read from its config as the engine reads it) and
    every entry of ARCHITECTURES.

    Capacity per dtype: `max_tokens_batch_1` (longest context of one sequence; None when a window
    caps every layer) and `max_sequences` of `capacity_tokens` tokens each.
    """
    models = [_model_memory(default_name, "config of the model the report ran on", default_shape, lengths,
                            dtypes, budget_bytes, capacity_tokens)]
    for name, source, fields in ARCHITECTURES:
        models.append(_model_memory(name, f"config.json of {source}", KVShape.from_config(fields),
                                    lengths, dtypes, budget_bytes, capacity_tokens, fields))
    return {"lengths": list(lengths), "dtypes": list(dtypes), "batch": 1, "budget_bytes": budget_bytes,
            "capacity_tokens": capacity_tokens, "models": models}
