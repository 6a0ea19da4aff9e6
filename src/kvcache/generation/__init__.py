"""Text generation on a kvcache model: prefill, then one decode step per token.

`generate` returns tokens and timings; `stream_generate` yields each step's tokens; the
sampling functions are pure (logits, settings, torch.Generator) -> tokens.
"""

from kvcache.generation.loop import GenerationResult, generate, stream_generate
from kvcache.generation.sampling import (
    SamplingSettings,
    apply_temperature,
    choose_next,
    greedy,
    sample,
    top_k_filter,
    top_p_filter,
)

__all__ = [
    "GenerationResult",
    "SamplingSettings",
    "apply_temperature",
    "choose_next",
    "generate",
    "greedy",
    "sample",
    "stream_generate",
    "top_k_filter",
    "top_p_filter",
]
