"""Text generation on a kvcache model: prefill, then one decode step per token.

`generate` returns tokens and timings; `stream_generate` yields each step's tokens (on a paged
cache as one-request paged steps, `paged_steps`; on the other kinds on the model's forward,
whose prompt is `prefill`); `SamplingParams` says how a request samples and stops (the
engine's too; `StructuredOutput` holds its output to a JSON schema or grammar), and
`choose_tokens` picks a batch's next tokens in one call.
"""

from kvcache.generation.loop import (
    GenerationResult,
    generate,
    prefill,
    resolve_eos,
    stream_generate,
)
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.generation.sampling import NonFiniteLogitsError, choose_tokens, top_k_filter, top_p_filter
from kvcache.generation.settings import GenerationSettings
from kvcache.generation.structured import StructuredOutput

__all__ = [
    "GenerationResult",
    "GenerationSettings",
    "NonFiniteLogitsError",
    "RequestError",
    "SamplingParams",
    "StructuredOutput",
    "choose_tokens",
    "generate",
    "prefill",
    "resolve_eos",
    "stream_generate",
    "top_k_filter",
    "top_p_filter",
]
