"""The names of the cache kinds and decode backends (standard library only, so the command line
can offer them as choices without importing torch)."""

#: `kvcache.make_cache` kinds ("quantized": int8 with its defaults; "none": keeps nothing)
CACHE_KINDS = ("dynamic", "static", "sliding", "quantized", "paged", "none")
#: `kvcache.backends.choose_backend` names ("auto": numpy for float32 CPU models, half for
#: bfloat16/float16 ones, where they apply, else torch)
BACKEND_NAMES = ("auto", "numpy", "half", "torch")
