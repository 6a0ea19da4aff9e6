"""kvcache: key-value caching for transformer inference.

Importing this package never imports torch: the reference lab (`kvcache.reference`) and the
memory planner (`kvcache.memory`) run on a bare Python. The torch parts (`kvcache.cache`, …)
are imported on first use.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

__version__ = "0.1.0"

# The numpy decode step runs its products on OpenBLAS's threads, which by default spin for 2**28
# cycles after each call before they sleep: a torch computation started meanwhile (a prefill
# after decode steps, the engine's prefill chunks between them) waits for the core one spins on.
# 2**20 cycles keeps them awake from one product of a step to the next and lets them sleep right
# after the step. OpenBLAS reads the variable when it loads, so this applies only when kvcache
# is imported before numpy (and torch, which imports numpy); a value already set is kept.
if "numpy" not in sys.modules:
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "20")

# name -> module that defines it; resolved lazily so `import kvcache` stays torch-free.
_LAZY = {
    "Cache": "kvcache.cache",
    "DynamicCache": "kvcache.cache",
    "StaticCache": "kvcache.cache",
    "SlidingWindowCache": "kvcache.cache",
    "NoCache": "kvcache.cache",
    "PagedCache": "kvcache.cache",
    "QuantizedCache": "kvcache.cache",
    "make_cache": "kvcache.cache",
    "load_model": "kvcache.model",
    "load_tokenizer": "kvcache.text.tokenizer",
    "generate": "kvcache.generation",
    "stream_generate": "kvcache.generation",
    "choose_backend": "kvcache.backends",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
