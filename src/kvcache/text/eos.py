"""The token ids a generation stops at when the caller names none: the one place they are read."""

from __future__ import annotations

from collections.abc import Sequence


def default_eos(config_eos: Sequence[int], tokenizer=None) -> tuple[int, ...]:
    """The model config's EOS ids (`config.eos_token_id`), then the tokenizer's EOS id where it
    has one the config lacks; () when neither names one."""
    ids = list(dict.fromkeys(config_eos))
    extra = None if tokenizer is None else getattr(tokenizer, "eos_token_id", None)
    if extra is not None and extra not in ids:
        ids.append(extra)
    return tuple(ids)
