"""Which transformers releases kvcache.hf speaks to, checked once on import.

The cache protocol it implements (a `Cache` of `CacheLayerMixin` layers asked for
`get_mask_sizes(query_length, layer_idx)` and `get_query_offset(layer_idx)`, the `cache=`
spelling beside the deprecated `past_key_values=`) is that of transformers 5.24; other 5.x
releases that changed it would fail deep inside a forward, so they are refused here by name.
"""

from __future__ import annotations

SUPPORTED = ">=5.24, <6"  # the releases kvcache.hf is tested against (the pin: 5.24.0)
_LOWEST, _BELOW = (5, 24), (6, 0)


class TransformersVersionError(ImportError):
    """transformers is missing, or a release whose cache protocol kvcache.hf does not speak."""


def _release(version: str) -> tuple[int, int]:
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit()) if not piece.isdigit() else piece
        parts.append(int(digits or 0))
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def check_transformers_version(version: str) -> None:
    """Raise `TransformersVersionError` unless `version` (transformers.__version__) is in
    `SUPPORTED`."""
    if not _LOWEST <= _release(version) < _BELOW:
        raise TransformersVersionError(
            f"kvcache.hf supports transformers {SUPPORTED}, found {version}: install one, e.g. "
            f"pip install 'transformers{SUPPORTED.replace(' ', '')}'"
        )


def require_transformers():
    """The transformers module, after checking its version."""
    try:
        import transformers
    except ImportError as error:
        raise TransformersVersionError(
            f"kvcache.hf needs transformers {SUPPORTED}, which is not installed: "
            f"pip install 'transformers{SUPPORTED.replace(' ', '')}'"
        ) from error
    check_transformers_version(transformers.__version__)
    return transformers
