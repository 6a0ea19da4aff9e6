"""Read the cache geometry (layer count, kv heads, head dim, window, kind per layer) from a
model config object or dict, reconciled with explicit sizes; contradictions raise."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import CacheConfigError

_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}


@dataclass(frozen=True)
class CacheGeometry:
    """What a cache needs to know of the model.

    layer_kinds: "full" or "sliding" per layer, or None when the layer count is unknown (layers
    are then created on first use, each of `default_kind`).
    """

    num_layers: int | None
    kv_heads: int | None
    head_dim: int | None
    window: int | None
    layer_kinds: tuple[str, ...] | None
    default_kind: str

    def require_window(self) -> int:
        """The sliding window; raise if a sliding layer has none."""
        if self.window is None:
            raise CacheConfigError(
                "a sliding layer needs a window: pass window= or a config with sliding_window"
            )
        return self.window


def _get(config: Any, name: str) -> Any:
    if config is None:
        return None
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def _merge(name: str, given: int | None, from_config: int | None) -> int | None:
    if given is not None and from_config is not None and given != from_config:
        raise CacheConfigError(f"{name}={given} contradicts the config's {name}={from_config}")
    value = given if given is not None else from_config
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CacheConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def read_geometry(
    config: Any = None,
    *,
    num_layers: int | None = None,
    window: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> CacheGeometry:
    """Merge `config` (attributes or dict keys num_hidden_layers, num_key_value_heads, head_dim,
    sliding_window, layer_types, use_sliding_window) with explicit sizes.

    Without layer_types, every layer is sliding when a window is known (as in Mistral) and
    full otherwise; `use_sliding_window=False` in the config turns the config's window off.
    """
    heads = _get(config, "num_key_value_heads") or _get(config, "num_attention_heads")
    dim = _get(config, "head_dim")
    if dim is None and _get(config, "hidden_size") and _get(config, "num_attention_heads"):
        dim = _get(config, "hidden_size") // _get(config, "num_attention_heads")
    config_window = _get(config, "sliding_window")
    if _get(config, "use_sliding_window") is False:
        config_window = None
    num_layers = _merge("num_layers", num_layers, _get(config, "num_hidden_layers"))
    window = _merge("window", window, config_window)
    kv_heads = _merge("kv_heads", kv_heads, heads)
    head_dim = _merge("head_dim", head_dim, dim)

    default_kind = "full" if window is None else "sliding"
    layer_types = _get(config, "layer_types") or None  # () means "not given"
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise CacheConfigError(
                f"layer_types may hold {sorted(_LAYER_TYPES)}, got unsupported {unknown}"
            )
        kinds = tuple(_LAYER_TYPES[t] for t in layer_types)
        if num_layers is not None and len(kinds) != num_layers:
            raise CacheConfigError(
                f"layer_types lists {len(kinds)} layers but num_layers is {num_layers}"
            )
        num_layers = len(kinds)
        if "sliding" in kinds and window is None:
            raise CacheConfigError("layer_types has sliding_attention layers but no window")
        default_kind = "full"
    elif num_layers is not None:
        kinds = (default_kind,) * num_layers
    else:
        kinds = None
    return CacheGeometry(num_layers, kv_heads, head_dim, window, kinds, default_kind)
