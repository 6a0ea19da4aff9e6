"""RoPE settings read from a config.json: the base (`rope_theta`) and the frequency scaling.

Newer configs put them in `rope_parameters`, older ones in `rope_theta` and `rope_scaling`;
gemma3_text gives one set per layer type (`rope_parameters.full_attention` and
`.sliding_attention`, or the older `rope_theta`, `rope_scaling` for the full layers and
`rope_local_base_freq` for the sliding ones). Unsupported scaling types raise ConfigError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvcache.model.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
# gemma3_text's bases when its config names none (transformers' defaults)
_GEMMA3_THETAS = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `rope_type` is one of SUPPORTED_ROPE_TYPES other than default."""

    rope_type: str
    factor: float
    # llama3 only
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None


def require_fields(raw: dict[str, Any], *names: str) -> None:
    """Raise ConfigError naming every one of `names` that `raw` lacks (or holds as null)."""
    missing = [name for name in names if raw.get(name) is None]
    if missing:
        raise ConfigError(f"config.json lacks required field(s): {', '.join(missing)}")


def rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """rope_theta and scaling, from the newer `rope_parameters` or the older `rope_scaling`."""
    for name in ("rope_parameters", "rope_scaling"):
        if raw.get(name) is not None and not isinstance(raw.get(name), dict):
            raise ConfigError(f"{name} must be a JSON object or null, got {raw.get(name)!r}")
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    return _theta(params.get("rope_theta", raw.get("rope_theta", 10000.0))), _scaling(params)


def gemma3_rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling | None, float]:
    """gemma3_text's (full layers' theta, their scaling, sliding layers' theta). The sliding
    layers' RoPE must be unscaled (every released gemma3 is): a scaled one is refused."""
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a JSON object or null, got {params!r}")
    params = params or {}
    if any(kind in params for kind in _GEMMA3_THETAS):  # one set per layer type
        sets = {}
        for kind, default_theta in _GEMMA3_THETAS.items():
            one = params.get(kind) or {}
            if not isinstance(one, dict):
                raise ConfigError(f"rope_parameters.{kind} must be a JSON object, got {one!r}")
            sets[kind] = rope_settings({"rope_parameters": one, "rope_theta": default_theta})
        (full_theta, full_scaling), (local_theta, local_scaling) = sets.values()
    else:  # the older layout
        full = {**raw, "rope_theta": raw.get("rope_theta", _GEMMA3_THETAS["full_attention"])}
        full_theta, full_scaling = rope_settings(full)
        local = raw.get("rope_local_base_freq", _GEMMA3_THETAS["sliding_attention"])
        local_theta, local_scaling = _theta(local, "rope_local_base_freq"), None
    if local_scaling is not None:
        raise ConfigError(
            f"RoPE scaling {local_scaling.rope_type!r} on gemma3's sliding layers is not supported "
            f"(only their base, rope_parameters.sliding_attention.rope_theta)"
        )
    return full_theta, full_scaling, local_theta


def _theta(theta: Any, name: str = "rope_theta") -> float:
    if isinstance(theta, bool) or not isinstance(theta, int | float):
        raise ConfigError(f"{name} must be a number, got {theta!r}")
    theta = float(theta)
    if not math.isfinite(theta) or theta <= 0:
        raise ConfigError(f"{name} must be positive, got {theta}")
    return theta


def _scaling(params: dict[str, Any]) -> RopeScaling | None:
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"rope scaling type {rope_type!r} is not supported; expected one of {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return None
    factor = params.get("factor")
    if factor is None or float(factor) < 1.0:
        raise ConfigError(f"rope scaling {rope_type!r} needs factor >= 1, got {factor!r}")
    if rope_type != "llama3":
        return RopeScaling(rope_type, float(factor))
    require_fields(params, "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    if float(params["high_freq_factor"]) <= float(params["low_freq_factor"]):
        raise ConfigError("llama3 rope scaling needs high_freq_factor > low_freq_factor")
    return RopeScaling(
        "llama3",
        float(factor),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )
