"""kvcache: key-value caching for transformer inference.

Importing this package never imports torch: the reference lab (`kvcache.reference`) and the
memory planner (`kvcache.memory`) run on a bare Python. The torch parts (`kvcache.cache`, …)
are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

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
    "load_tokenizer": "kvcache.tokenizer",
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
