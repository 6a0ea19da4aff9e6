"""The one reader of a model config's geometry (standard library only).

Layers, attention heads, kv heads, head_dim, the sliding window and which layers it applies to,
read from a Hugging Face `config.json` (a dict), or from any object with those attribute names
(kvcache's `ModelConfig`, a transformers config). The model config, the cache and the memory
planner all ask here, so they cannot disagree about what a checkpoint's layers hold.

Per-family rules, as transformers applies them (to a dict and to an object alike):
- `layer_types` given: each layer as listed; with no window in force, every layer is full.
- llama: no sliding window, even when the config carries a `sliding_window` key.
- qwen2 and qwen3: the window is in force only with `use_sliding_window` true; layers from
  `max_window_layers` on are sliding, the ones before full.
- gemma2 and gemma3_text without `layer_types`: transformers' pattern, every second layer
  (gemma2) or every `sliding_window_pattern`-th (gemma3_text, default 6) full and the others
  sliding; a config without `sliding_window` gets the family's default window (4096).
- any other family with a window (mistral, …): every layer is sliding.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


class GeometryError(ValueError):
    """A config whose geometry fields have the wrong type or contradict each other."""


@dataclass(frozen=True)
class Geometry:
    """What a config says about the shape of attention. A field is None when the config does not
    give it (a partial config, e.g. only num_hidden_layers for a cache).

    layer_types: one of LAYER_TYPES per layer (None when the layer count is unknown);
    sliding_window: the window in force (None: no layer is windowed).
    """

    model_type: str | None
    num_layers: int | None
    num_heads: int | None
    kv_heads: int | None
    head_dim: int | None
    hidden_size: int | None
    sliding_window: int | None
    layer_types: tuple[str, ...] | None

    def default_layer_type(self) -> str:
        """The type of a layer when the count is unknown (layers created as they are used)."""
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION

    def require(self, *names: str, source: str = "config") -> None:
        """Raise GeometryError naming the config fields behind every one of `names` (attributes
        of this class) that is None."""
        missing = [_CONFIG_FIELDS.get(name, name) for name in names if getattr(self, name) is None]
        if missing:
            raise GeometryError(f"{source} lacks the field(s) {', '.join(missing)}")


# the config.json fields each Geometry attribute is read from, for messages
_CONFIG_FIELDS = {
    "num_layers": "num_hidden_layers",
    "num_heads": "num_attention_heads",
    "kv_heads": "num_key_value_heads or num_attention_heads",
    "head_dim": "head_dim or hidden_size",
    "hidden_size": "hidden_size",
}


def _field(config: Any, name: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(name)
    return getattr(config, name, None)


# the largest value each size may take: far past every released model, small enough that nothing
# sized by a stranger's config (a list per layer, a buffer per head) runs away before a tensor
# is checked against it
SIZE_LIMITS = {
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 8192,
    "hidden_size": 1 << 17,
    "sliding_window": 1 << 24,
}


def _size(config: Any, name: str, source: str) -> int | None:
    value = _field(config, name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GeometryError(f"{source}: {name} must be a positive integer, got {value!r}")
    if value > SIZE_LIMITS.get(name, value):
        raise GeometryError(
            f"{source}: {name}={value:,} is past the largest kvcache accepts ({SIZE_LIMITS[name]:,}); "
            f"no released model comes near it"
        )
    return value


def text_config(config: Any) -> Any:
    """The config that describes the language model: a multimodal config's `text_config` when
    the top level has no layer count, else the config itself."""
    inner = _field(config, "text_config")
    if _field(config, "num_hidden_layers") is None and inner is not None:
        return inner
    return config


def read_geometry(config: Any, source: str = "config") -> Geometry:
    """The geometry of `config` (a dict or an object with the same attribute names).

    Reads num_hidden_layers, num_attention_heads, num_key_value_heads (else the attention
    heads), head_dim (else hidden_size / num_attention_heads), sliding_window, layer_types and
    the family rules in the module docstring. Raises GeometryError for a field of the wrong type
    or a contradiction (layer_types of the wrong length or an unknown type). `source` names the
    config in messages.
    """
    config = text_config(config)
    model_type = _field(config, "model_type")
    num_layers = _size(config, "num_hidden_layers", source)
    num_heads = _size(config, "num_attention_heads", source)
    kv_heads = _size(config, "num_key_value_heads", source) or num_heads
    hidden = _size(config, "hidden_size", source)
    head_dim = _size(config, "head_dim", source)
    if head_dim is None and hidden is not None and num_heads is not None:
        if hidden % num_heads:
            raise GeometryError(
                f"{source}: hidden_size={hidden} is not divisible by num_attention_heads={num_heads}"
            )
        head_dim = hidden // num_heads
    window = _window(config, model_type, source)
    layer_types = _layer_types(config, model_type, num_layers, window, source)
    if layer_types is not None:
        num_layers = len(layer_types)
    return Geometry(model_type, num_layers, num_heads, kv_heads, head_dim, hidden, window, layer_types)


# families whose configs slide some layers even when config.json names no window, and their
# transformers default; and the period of their full-attention layers when layer_types is absent
_DEFAULT_WINDOWS = {"gemma2": 4096, "gemma3_text": 4096}
_FULL_LAYER_PERIODS = {"gemma2": 2, "gemma3_text": 6}


def _window(config: Any, model_type: str | None, source: str) -> int | None:
    """The sliding window in force, after the family rules."""
    if model_type == "llama":
        return None
    if model_type in ("qwen2", "qwen3") and not _field(config, "use_sliding_window"):
        return None
    if _field(config, "use_sliding_window") is False:
        return None
    window = _size(config, "sliding_window", source)
    return _DEFAULT_WINDOWS.get(model_type) if window is None else window


def _layer_types(
    config: Any, model_type: str | None, num_layers: int | None, window: int | None, source: str
) -> tuple[str, ...] | None:
    listed = _field(config, "layer_types")
    if listed:  # () or [] means "not given"
        if isinstance(listed, str) or not all(isinstance(kind, str) for kind in listed):
            raise GeometryError(f"{source}: layer_types must be a list of strings, got {listed!r}")
        unknown = sorted(set(listed) - set(LAYER_TYPES))
        if unknown:
            raise GeometryError(f"{source}: layer_types may hold {list(LAYER_TYPES)}, got {unknown}")
        if num_layers is not None and len(listed) != num_layers:
            raise GeometryError(
                f"{source}: layer_types lists {len(listed)} layers but num_hidden_layers is {num_layers}"
            )
        if window is None:  # no window in force: a "sliding" layer attends to everything
            return (FULL_ATTENTION,) * len(listed)
        return tuple(listed)
    if num_layers is None:
        return None
    if window is None:
        return (FULL_ATTENTION,) * num_layers
    if model_type in ("qwen2", "qwen3"):
        first_sliding = _field(config, "max_window_layers")
        if first_sliding is None:
            first_sliding = num_layers
        if isinstance(first_sliding, bool) or not isinstance(first_sliding, int) or first_sliding < 0:
            raise GeometryError(f"{source}: max_window_layers must be an integer >= 0, got {first_sliding!r}")
        return tuple(SLIDING_ATTENTION if i >= first_sliding else FULL_ATTENTION for i in range(num_layers))
    if model_type in _FULL_LAYER_PERIODS:
        period = _FULL_LAYER_PERIODS[model_type]
        if model_type == "gemma3_text":
            given = _field(config, "sliding_window_pattern")
            period = period if given is None else given
            if isinstance(period, bool) or not isinstance(period, int) or period < 1:
                raise GeometryError(
                    f"{source}: sliding_window_pattern must be a positive integer, got {period!r}"
                )
        return tuple(FULL_ATTENTION if (i + 1) % period == 0 else SLIDING_ATTENTION
                     for i in range(num_layers))
    return (SLIDING_ATTENTION,) * num_layers
