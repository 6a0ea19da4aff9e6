"""Text generation on a kvcache model: prefill, then one decode step per token.

`generate` returns tokens and timings; `stream_generate` yields each step's tokens; `prefill`
and `decode_step` are its two steps; the sampling functions are pure (logits, settings,
torch.Generator) -> tokens.
"""

from kvcache.generation.loop import (
    GenerationResult,
    decode_step,
    generate,
    prefill,
    resolve_eos,
    stream_generate,
)
from kvcache.generation.sampling import (
    SamplingSettings,
    apply_temperature,
    choose_next,
    greedy,
    sample,
    top_k_filter,
    top_p_filter,
)
from kvcache.generation.settings import GenerationSettings

__all__ = [
    "GenerationResult",
    "GenerationSettings",
    "SamplingSettings",
    "apply_temperature",
    "choose_next",
    "decode_step",
    "generate",
    "greedy",
    "prefill",
    "resolve_eos",
    "sample",
    "stream_generate",
    "top_k_filter",
    "top_p_filter",
]
