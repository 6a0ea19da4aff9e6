"""The cache's view of a model's geometry: `kvcache.geometry` (the one reader of a config)
merged with explicit sizes given to a cache; contradictions raise `CacheConfigError`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION, GeometryError, read_geometry

from .errors import CacheConfigError

_KINDS = {FULL_ATTENTION: "full", SLIDING_ATTENTION: "sliding"}


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
                "a sliding layer needs a window, and the config has no sliding_window in force (the "
                "model attends to its whole context, so a window would change its output); pass "
                "window= to make one on purpose"
            )
        return self.window


def _merge(name: str, given: int | None, from_config: int | None) -> int | None:
    if given is not None and from_config is not None and given != from_config:
        raise CacheConfigError(f"{name}={given} contradicts the config's {name}={from_config}")
    value = given if given is not None else from_config
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise CacheConfigError(f"{name} must be an int >= 1, got {value!r}")
    return value


def read_cache_geometry(
    config: Any = None,
    *,
    num_layers: int | None = None,
    window: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> CacheGeometry:
    """The geometry of `config` (a config.json dict, a ModelConfig or any object with the same
    attribute names; read by `kvcache.geometry.read_geometry`, family rules included) merged with
    explicit sizes, which must agree with it.

    When the config has a window in force, its layer types say which layers slide; otherwise an
    explicit `window` makes every layer sliding, and without one every layer is full.
    """
    try:
        geometry = read_geometry({} if config is None else config)
    except GeometryError as error:
        raise CacheConfigError(str(error)) from None
    num_layers = _merge("num_layers", num_layers, geometry.num_layers)
    window = _merge("window", window, geometry.sliding_window)
    kv_heads = _merge("kv_heads", kv_heads, geometry.kv_heads)
    head_dim = _merge("head_dim", head_dim, geometry.head_dim)

    if geometry.sliding_window is not None and geometry.layer_types is not None:
        # the config's window is in force: it says which layers slide
        kinds: tuple[str, ...] | None = tuple(_KINDS[kind] for kind in geometry.layer_types)
        default_kind = "full"
    else:  # an explicit window (or none) applies to every layer alike
        default_kind = "full" if window is None else "sliding"
        kinds = None if num_layers is None else (default_kind,) * num_layers
    return CacheGeometry(num_layers, kv_heads, head_dim, window, kinds, default_kind)
