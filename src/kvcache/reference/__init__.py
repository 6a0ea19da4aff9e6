"""`kvcache.reference`: what a KV cache is, by hand, with every multiplication counted.

Standard library only (no torch, no numpy). Vectors are lists of floats; a matrix is a list of
rows (d_out rows of length d_in). Every multiplication goes through `mul`, whose count
`muls()` reads and `reset_muls()` clears; nothing else is counted.
"""

from kvcache.memory import kv_cache_bytes, kv_cache_elements
from kvcache.reference.compare import allclose, max_abs_diff
from kvcache.reference.counting import counted, mul, muls, reset_muls
from kvcache.reference.decoder import DecodeResult, TinyDecoder, TinyDecoderConfig
from kvcache.reference.linalg import attend, dot, matvec, project, softmax
from kvcache.reference.single_head import (
    KVCache,
    generate_cached,
    generate_nocache,
    step_cached,
    step_nocache,
)
from kvcache.reference.tables import mul_table

__all__ = [
    "DecodeResult", "KVCache", "TinyDecoder", "TinyDecoderConfig", "allclose", "attend",
    "counted", "dot", "generate_cached", "generate_nocache", "kv_cache_bytes",
    "kv_cache_elements", "matvec", "max_abs_diff", "mul", "mul_table", "muls", "project",
    "reset_muls", "softmax", "step_cached", "step_nocache",
]
