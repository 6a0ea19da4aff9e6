"""The model configuration: a frozen dataclass read from a checkpoint's `config.json`.

One class covers the Llama family we run (`llama`, `mistral`, `qwen2`, `qwen3`, `phi3`, whose
fused projections the loader splits, `olmo2`, `gemma`, `gemma2`, `gemma3_text`); the differences
are fields (`qkv_bias`, `qk_norm`, `norm_placement`, gemma's scalings and soft-capping,
`sliding_window`, `layer_types`, `rope_scaling`, gemma3's `local_rope_theta`). A field a gemma
config leaves out takes transformers' default for that family. Anything the model
would otherwise ignore (an unknown architecture, activation, RoPE scaling type or a partial
rotary factor) is refused here with a `ConfigError` that says what was expected and what was given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvcache.files import read_json_object
from kvcache.geometry import FULL_ATTENTION, SIZE_LIMITS, SLIDING_ATTENTION, GeometryError, read_geometry
from kvcache.model.errors import ConfigError
from kvcache.model.rope_settings import (
    SUPPORTED_ROPE_TYPES,
    RopeScaling,
    gemma3_rope_settings,
    require_fields,
    rope_settings,
)

__all__ = ["SUPPORTED_ROPE_TYPES", "ConfigError", "ModelConfig", "RopeScaling"]

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "gemma3_text"
)
GEMMA_FAMILIES = ("gemma", "gemma2", "gemma3_text")
# transformers' values for gemma config fields a config.json leaves out (an explicit null stays)
_GEMMA_DEFAULTS = {
    "gemma": dict(tie_word_embeddings=True),
    "gemma2": dict(tie_word_embeddings=True, query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0),
    "gemma3_text": dict(tie_word_embeddings=True, query_pre_attn_scalar=256, attn_logit_softcapping=None,
                        final_logit_softcapping=None),
}
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# where each layer's RMSNorms sit: one name per placement, the checkpoint's norm names in order
NORM_PLACEMENTS = {
    "pre": ("input", "post_attention"),  # llama: before attention, before the MLP
    "post": ("post_attention", "post_feedforward"),  # olmo2: after each sublayer
    "sandwich": ("input", "post_attention", "pre_feedforward", "post_feedforward"),  # gemma2
}


# sizes kvcache.geometry does not read, bounded the same way (see SIZE_LIMITS)
_MORE_LIMITS = {"vocab_size": 1 << 22, "intermediate_size": 1 << 20, "max_position_embeddings": 1 << 24}


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs to know, with Hugging Face's field names where they exist."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    local_rope_theta: float | None = None  # gemma3: the sliding layers' own base; None: rope_theta
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # q_proj, k_proj, v_proj carry a bias (qwen2; llama attention_bias)
    o_bias: bool = False  # o_proj carries a bias (llama attention_bias)
    mlp_bias: bool = False
    # queries and keys RMS-normalised before RoPE: None, "head" (each head's D values: qwen3) or
    # "width" (all heads' H·D values at once, right after the projection: olmo2)
    qk_norm: str | None = None
    # NORM_PLACEMENTS key: "pre" (llama), "post" (olmo2), "sandwich" (gemma2)
    norm_placement: str = "pre"
    hidden_act: str = "silu"  # or gemma's "gelu_pytorch_tanh"
    norm_weight_offset: float = 0.0  # gemma's RMSNorm scales by (offset + weight), offset 1
    embedding_scale: float | None = None  # gemma: embeddings times sqrt(hidden_size)
    attention_scale: float | None = None  # the q·k scale; None: 1/sqrt(head_dim)
    attn_logit_softcap: float | None = None  # gemma2: scores -> cap · tanh(scores / cap)
    final_logit_softcap: float | None = None  # gemma2: logits -> cap · tanh(logits / cap)
    sliding_window: int | None = None
    # one entry per layer: "full_attention" or "sliding_attention"
    layer_types: tuple[str, ...] = field(default=())
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    torch_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name, limit in (*SIZE_LIMITS.items(), *_MORE_LIMITS.items()):
            value = getattr(self, name, None)
            if isinstance(value, int) and value > limit:  # before anything is sized by it
                raise ConfigError(
                    f"{name}={value:,} is past the largest kvcache accepts ({limit:,}); no released "
                    f"model comes near it"
                )
        position = self.max_position_embeddings
        if not isinstance(position, int) or isinstance(position, bool) or position <= 0:
            raise ConfigError(f"max_position_embeddings must be a positive integer, got {position!r}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ConfigError(
                f"norm_placement must be one of {sorted(NORM_PLACEMENTS)}, got {self.norm_placement!r}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act must be one of {SUPPORTED_ACTIVATIONS}, got {self.hidden_act!r}")
        if self.qk_norm not in (None, "head", "width"):
            raise ConfigError(f"qk_norm must be None, 'head' or 'width', got {self.qk_norm!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries, expected num_hidden_layers="
                f"{self.num_hidden_layers}"
            )
        for kind in self.layer_types:
            if kind not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ConfigError(
                    f"layer type {kind!r} is not supported; expected {FULL_ATTENTION!r} or "
                    f"{SLIDING_ATTENTION!r}"
                )
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ConfigError("layer_types has sliding_attention layers but no sliding_window")
        if self.model_type == "llama" and self.sliding_window is not None:
            raise ConfigError(
                "a llama config has no sliding window (transformers ignores the key); use "
                "model_type 'mistral' for a model whose layers slide"
            )
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(f"sliding_window must be positive, got {self.sliding_window}")

    @property
    def use_sliding_window(self) -> bool:
        """Whether a window is in force: qwen2's flag, so that `kvcache.geometry.read_geometry`
        reads this object's window and layer types as they are."""
        return self.sliding_window is not None

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full attention), what `Cache.begin` is given so the
        window applies whatever cache the model is handed."""
        return tuple(self.sliding_window if kind == SLIDING_ATTENTION else None for kind in self.layer_types)

    @property
    def num_key_value_groups(self) -> int:
        """Query heads per key/value head (1 = multi-head attention, >1 = grouped-query)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Read a parsed config.json; unsupported settings raise ConfigError."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} is not supported; expected one of "
                              f"{SUPPORTED_MODEL_TYPES}")
        gemma = model_type in GEMMA_FAMILIES
        raw = {**_GEMMA_DEFAULTS.get(model_type, {}), **raw}
        hidden_act = _checked_supported(raw, model_type)
        try:
            geometry = read_geometry(raw, source="config.json")
        except GeometryError as error:
            raise ConfigError(str(error)) from None
        if model_type == "gemma3_text":
            rope_theta, rope_scaling, local_rope_theta = gemma3_rope_settings(raw)
        else:
            (rope_theta, rope_scaling), local_rope_theta = rope_settings(raw), None
        rope_parameters = raw.get("rope_parameters") or {}  # (a JSON object: checked by rope_settings)
        partial = raw.get("partial_rotary_factor", rope_parameters.get("partial_rotary_factor"))
        if float(1.0 if partial is None else partial) != 1.0:
            raise ConfigError("partial_rotary_factor other than 1.0 is not supported")
        qkv_bias, o_bias = _attention_biases(raw, model_type)
        scaled = model_type in ("gemma2", "gemma3_text")  # query scale and soft-caps of their own
        eos_ids = _checked_special_ids(raw)
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=geometry.num_layers,
            num_attention_heads=geometry.num_heads,
            num_key_value_heads=geometry.kv_heads,
            head_dim=geometry.head_dim,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            local_rope_theta=local_rope_theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)) if model_type == "llama" else False,
            qk_norm={"qwen3": "head", "olmo2": "width", "gemma3_text": "head"}.get(model_type),
            norm_placement={"olmo2": "post", "gemma2": "sandwich", "gemma3_text": "sandwich"}.get(
                model_type, "pre"),
            hidden_act=hidden_act,
            norm_weight_offset=1.0 if gemma else 0.0,
            embedding_scale=raw["hidden_size"] ** 0.5 if gemma else None,
            attention_scale=_positive(raw, "query_pre_attn_scalar") ** -0.5 if scaled else None,
            attn_logit_softcap=_positive(raw, "attn_logit_softcapping", optional=True) if scaled else None,
            final_logit_softcap=_positive(raw, "final_logit_softcapping", optional=True) if scaled else None,
            sliding_window=geometry.sliding_window,
            layer_types=geometry.layer_types,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=eos_ids,
            pad_token_id=raw.get("pad_token_id"),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (or a folder holding one). EOS ids of a `generation_config.json`
        beside it are added to config.json's (generation stops at either, as in transformers)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        config = cls.from_dict(_read_json(path))
        generation = path.with_name("generation_config.json")
        if generation.is_file():
            eos = _read_json(generation).get("eos_token_id")
            extra = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in extra):
                raise ConfigError(f"{generation}: eos_token_id must be token ids, got {eos!r}")
            config = replace(config, eos_token_id=tuple(dict.fromkeys((*config.eos_token_id, *extra))))
        return config


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, "config file", ConfigError)



def _checked_supported(raw: dict[str, Any], model_type) -> str:
    """The config's activation, after refusing (ConfigError) a missing size, or an activation
    or attention kvcache does not run."""
    require_fields(
        raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"
    )
    hidden_act = _activation(raw, model_type)
    if hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ConfigError(
            f"hidden_act {hidden_act!r} is not supported; expected one of {SUPPORTED_ACTIVATIONS}"
        )
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention is not supported (kvcache runs causal decoders)")
    return hidden_act


def _attention_biases(raw: dict[str, Any], model_type: str) -> tuple[bool, bool]:
    """(q/k/v projections biased, output projection biased), as each family's config says."""
    if model_type == "qwen2":
        return True, False
    if model_type in ("llama", "qwen3", "olmo2", *GEMMA_FAMILIES):
        biased = bool(raw.get("attention_bias", False))
        return biased, biased
    return False, False


def _checked_special_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    """The EOS ids (one or a list), after checking they and the BOS id are token ids of the
    vocabulary (pad_token_id is left as given: old configs write -1, and the model never reads
    it)."""
    eos = raw.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    vocab = raw["vocab_size"]
    for name, ids in (("eos_token_id", eos_ids), ("bos_token_id", (raw.get("bos_token_id"),))):
        for token in ids:
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                      or not isinstance(vocab, int) or not 0 <= token < vocab):
                raise ConfigError(f"{name} must be token ids in [0, vocab_size={vocab}), got {token!r}")
    return eos_ids

def _activation(raw: dict[str, Any], model_type: str) -> str:
    """The MLP's activation as transformers reads it: gemma2 and gemma3 name it
    `hidden_activation`; gemma's legacy `hidden_act: "gelu"` means the tanh approximation."""
    if model_type in ("gemma2", "gemma3_text"):
        return raw.get("hidden_activation") or "gelu_pytorch_tanh"
    if model_type == "gemma":
        act = raw.get("hidden_act") or "gelu_pytorch_tanh"
        return "gelu_pytorch_tanh" if act == "gelu" else act
    return raw.get("hidden_act", "silu")


def _positive(raw: dict[str, Any], name: str, optional: bool = False) -> float | None:
    """raw[name] as a positive float; missing (or null): None when optional, else an error."""
    value = raw.get(name)
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)
