"""KV-cache memory accounting and capacity planning (standard library only).

    elements = 2 (K and V) × layers × kv_heads × tokens × head_dim (× batch)
    bytes    = elements × bytes per element of the dtype

A layer with a sliding window holds at most `window` tokens. Shapes come from numbers or from
a Hugging Face `config.json` (`KVShape.from_config`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.files import read_json_object
from kvcache.geometry import FULL_ATTENTION, SLIDING_ATTENTION, Geometry, GeometryError, read_geometry

# bits per stored element; int4 packs two elements per byte.
DTYPE_BITS: dict[str, int] = {
    "float64": 64,
    "float32": 32,
    "float16": 16,
    "bfloat16": 16,
    "float8_e4m3fn": 8,
    "float8_e5m2": 8,
    "int8": 8,
    "int4": 4,
}
_DTYPE_ALIASES = {
    "fp64": "float64",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "fp8": "float8_e4m3fn",
}

FULL, SLIDING = FULL_ATTENTION, SLIDING_ATTENTION


def dtype_bits(dtype: str) -> int:
    """Bits per element of a dtype name ("bfloat16", "int4", "torch.float16" …)."""
    name = _canonical(dtype)
    if name not in DTYPE_BITS:
        raise ValueError(f"unknown dtype {dtype!r}; known: {', '.join(DTYPE_BITS)}")
    return DTYPE_BITS[name]


def _canonical(dtype: str) -> str:
    """A dtype's name without "torch." and aliases ("fp16" is "float16")."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if value < 0:
            raise ValueError(f"{name} must be ≥ 0, got {value}")


def kv_cache_elements(n_layers: int, n_heads: int, seq_len: int, head_dim: int, batch: int = 1) -> int:
    """2 · layers · kv_heads · tokens · head_dim · batch: elements held by a full KV cache."""
    _check_sizes(n_layers=n_layers, n_heads=n_heads, seq_len=seq_len, head_dim=head_dim, batch=batch)
    return 2 * n_layers * n_heads * seq_len * head_dim * batch


def kv_cache_bytes(
    n_layers: int, n_heads: int, seq_len: int, head_dim: int, batch: int = 1, dtype: str = "float16"
) -> int:
    """Bytes of a full KV cache: elements × bytes per element (int4: half a byte; exact,
    since the element count is even)."""
    bits = dtype_bits(dtype)
    return kv_cache_elements(n_layers, n_heads, seq_len, head_dim, batch) * bits // 8


@dataclass(frozen=True)
class KVShape:
    """The numbers that set a model's KV-cache size.

    `layer_types` gives each layer's kind ("full_attention" or "sliding_attention"); a sliding
    layer holds at most `sliding_window` tokens. `None` means every layer is full.
    """

    layers: int
    kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        _check_sizes(layers=self.layers, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.layer_types is not None:
            if len(self.layer_types) != self.layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries but layers={self.layers}")
            unknown = set(self.layer_types) - {FULL, SLIDING}
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)}; known: {FULL}, {SLIDING}")
            if SLIDING in self.layer_types and not self.sliding_window:
                raise ValueError("layer_types has sliding layers but sliding_window is not set")

    def tokens_held(self, seq_len: int) -> list[int]:
        """Tokens each layer holds after `seq_len` tokens (sliding layers cap at the window)."""
        _check_sizes(seq_len=seq_len)
        types = self.layer_types or (FULL,) * self.layers
        return [min(seq_len, self.sliding_window) if kind == SLIDING else seq_len for kind in types]

    def bytes(self, seq_len: int, batch: int = 1, dtype: str = "float16") -> int:
        """KV bytes for `batch` sequences of `seq_len` tokens each."""
        held = sum(self.tokens_held(seq_len))
        return kv_cache_bytes(1, self.kv_heads, held, self.head_dim, batch, dtype)

    def bytes_per_token(self, dtype: str = "float16") -> int:
        """Bytes one more token costs while every layer is still growing (before any window)."""
        return kv_cache_bytes(self.layers, self.kv_heads, 1, self.head_dim, 1, dtype)

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | os.PathLike) -> KVShape:
        """From a Hugging Face config (a dict, or a path to config.json or its folder).

        Read by `kvcache.geometry.read_geometry`, as the model and the cache read it: layers, kv
        heads, head_dim, and the window and layer types after each family's rules (a llama
        `sliding_window` key is ignored, qwen2's window needs `use_sliding_window`, …). A
        multimodal config's `text_config` is used when present.
        """
        source = "config"
        if not isinstance(config, Mapping):
            path = os.fspath(config)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            source = path
            if not os.path.isfile(path):
                raise ValueError(f"no config.json at {path}")
            config = read_json_object(path, "config file")
        return cls.from_geometry(read_geometry(config, source), source)

    @classmethod
    def from_geometry(cls, geometry: Geometry, source: str = "config") -> KVShape:
        """From a geometry read by `kvcache.geometry.read_geometry` (the reader the model and the
        cache use, so all three agree on windows and layer types)."""
        try:
            geometry.require("num_layers", "kv_heads", "head_dim", source=source)
        except GeometryError as error:
            raise ValueError(f"{error} (needed for KV memory)") from None
        assert geometry.num_layers and geometry.kv_heads and geometry.head_dim
        sliding = geometry.layer_types is not None and SLIDING in geometry.layer_types
        return cls(
            geometry.num_layers,
            geometry.kv_heads,
            geometry.head_dim,
            geometry.sliding_window if sliding else None,
            geometry.layer_types if sliding else None,
        )


def max_tokens(shape: KVShape, budget_bytes: int, batch: int = 1, dtype: str = "float16") -> int | None:
    """The longest context (tokens per sequence) whose KV cache for `batch` sequences fits in
    `budget_bytes`; None when there is no limit (every layer sliding, and the window fits)."""
    _check_sizes(budget_bytes=budget_bytes, batch=batch)

    def fits(tokens: int) -> bool:
        return shape.bytes(tokens, batch, dtype) <= budget_bytes

    if shape.layer_types and FULL not in shape.layer_types and fits(shape.sliding_window):
        return None
    if shape.bytes(1, batch, dtype) == 0:
        return None  # zero-sized shape: nothing ever grows
    high = 1
    while fits(high):  # bytes grow with tokens (some layer is full), so this ends
        high *= 2
    low = high // 2 if high > 1 else 0  # fits(low), not fits(high)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def max_sequences(shape: KVShape, budget_bytes: int, seq_len: int, dtype: str = "float16") -> int:
    """How many sequences of `seq_len` tokens fit in `budget_bytes` of KV cache."""
    _check_sizes(budget_bytes=budget_bytes, seq_len=seq_len)
    one = shape.bytes(seq_len, 1, dtype)
    if one == 0:
        raise ValueError("a sequence of 0 bytes: every sequence fits; give seq_len ≥ 1")
    return budget_bytes // one


# ---- paged caches: whole blocks -------------------------------------------------------------
def blocks_for_tokens(seq_len: int, block_size: int) -> int:
    """Blocks of `block_size` tokens that hold `seq_len` tokens (the last one possibly partial)."""
    _check_sizes(seq_len=seq_len, block_size=block_size)
    if block_size < 1:
        raise ValueError("block_size must be ≥ 1")
    return -(-seq_len // block_size)


def _layer_counts(shape: KVShape) -> tuple[int, int]:
    """(full-attention layers, sliding-window layers) of `shape`."""
    sliding = sum(kind == SLIDING for kind in shape.layer_types or ())
    return shape.layers - sliding, sliding


def window_blocks_per_sequence(window: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence holds in a sliding layer of a paged cache during a forward of
    up to `chunk` new tokens: its last window - 1 positions and the chunk, one block more when they
    start inside a block."""
    return -(-(window - 1 + chunk) // block_size) + 1


def window_blocks_held(seq_len: int, window: int, block_size: int) -> int:
    """Blocks a sequence of `seq_len` tokens holds in a sliding layer of a paged cache between
    forwards: from the block of position seq_len - window + 1 (the first the next token sees) to its
    last."""
    if seq_len == 0:
        return 0
    return blocks_for_tokens(seq_len, block_size) - max(0, seq_len - window + 1) // block_size


#: the dtypes a paged pool stores keys and values in (`PagedCache(kv_dtype=)`, `--kv-cache-dtype`):
#: float rows as they are, or quantized rows packed with a float16 scale and zero point after
#: their codes (`kvcache.cache.paged.formats`: fp8 e4m3 scaled per row, int8 and int4
#: asymmetric); keys and values may differ: "int8/int4" is int8 keys and int4 values
PAGED_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8", "int8", "int4")
PACKED_KV_DTYPES = ("fp8", "int8", "int4")
PACKED_SCALE_BYTES = 4


def kv_part_name(dtype: str) -> str:
    """One side's KV dtype as a paged pool names it: aliases resolved ("bf16" is "bfloat16"),
    "float8_e4m3fn" is "fp8"."""
    name = _canonical(dtype)
    return "fp8" if name == "float8_e4m3fn" else name


def kv_dtype_pair(dtype: str) -> tuple[str, str]:
    """(keys' dtype, values' dtype) of a KV dtype name, each as `kv_part_name` names it: "int8"
    both, "int8/int4" keys int8 and values int4."""
    keys, _, values = str(dtype).partition("/")
    return kv_part_name(keys), kv_part_name(values or keys)


def paged_kv_dtype(dtype: str | None) -> bool:
    """Whether `dtype` names what a paged pool may store: one of PAGED_KV_DTYPES (or an alias)
    or a keys/values pair of them ("int8/int4", "bfloat16/int4")."""
    return dtype is not None and all(part in PAGED_KV_DTYPES for part in kv_dtype_pair(dtype))


def kv_dtype_name(keys: str, values: str) -> str:
    """The KV dtype name of keys and values in these dtypes ("int8", or "int8/int4")."""
    keys, values = kv_part_name(keys), kv_part_name(values)
    return keys if keys == values else f"{keys}/{values}"


def paged_row_bytes(head_dim: int, dtype: str = "float16") -> int:
    """Bytes of one row a paged pool stores (one token's keys, or values, of one kv head):
    head_dim elements of `dtype`, and a quantized row's scale and zero point (fp8, int8, int4)."""
    _check_sizes(head_dim=head_dim)
    extra = PACKED_SCALE_BYTES if kv_part_name(dtype) in PACKED_KV_DTYPES else 0
    return head_dim * dtype_bits(dtype) // 8 + extra


def paged_block_bytes(shape: KVShape, block_size: int, dtype: str = "float16") -> int:
    """Bytes of one block of the full-attention layers (keys and values of `block_size` tokens in
    each, `paged_row_bytes` per row: scales included; dtype may name keys' and values' apart,
    "int8/int4"); 0 when every layer slides."""
    blocks_for_tokens(0, block_size)  # checks block_size
    full, _ = _layer_counts(shape)
    return full * shape.kv_heads * block_size * _kv_row_bytes(shape.head_dim, dtype)


def window_block_bytes(shape: KVShape, block_size: int, dtype: str = "float16") -> int:
    """Bytes of one block of the sliding-window layers; 0 when none slides."""
    blocks_for_tokens(0, block_size)
    _, sliding = _layer_counts(shape)
    return sliding * shape.kv_heads * block_size * _kv_row_bytes(shape.head_dim, dtype)


def _kv_row_bytes(head_dim: int, dtype: str) -> int:
    """Bytes of one token's key row and value row of one kv head (`kv_dtype_pair`'s dtypes)."""
    return sum(paged_row_bytes(head_dim, part) for part in kv_dtype_pair(dtype))


def kv_window_bytes(shape: KVShape, window: int, dtype: str = "float32", sequences: int = 1) -> int:
    """Bytes of a paged cache's full-precision window (`PagedCache(kv_window=)`): the last
    `window` tokens' keys and values of every layer of `sequences` sequences, kept in the
    forward's `dtype` beside their blocks."""
    _check_sizes(window=window, sequences=sequences)
    return 2 * shape.layers * shape.kv_heads * window * shape.head_dim * dtype_bits(dtype) // 8 * sequences


def paged_kv_cache_bytes(
    shape: KVShape, seq_len: int, block_size: int, batch: int = 1, dtype: str = "float16"
) -> int:
    """KV bytes of `batch` sequences of `seq_len` tokens in a paged cache between forwards: each
    holds whole blocks (its last block's unused slots count too, at most block_size - 1 tokens) of
    every full-attention layer, and of each sliding layer only the blocks its window still needs."""
    _check_sizes(batch=batch)
    full = blocks_for_tokens(seq_len, block_size) * paged_block_bytes(shape, block_size, dtype)
    held = window_blocks_held(seq_len, shape.sliding_window, block_size) if shape.sliding_window else 0
    return batch * (full + held * window_block_bytes(shape, block_size, dtype))


def window_pool_blocks(shape: KVShape, block_size: int, *, max_sequences: int, chunk: int) -> int:
    """Blocks the sliding-window layers of a paged pool need so that `max_sequences` sequences in
    forwards of up to `chunk` tokens never run short (0 when no layer slides)."""
    _check_sizes(max_sequences=max_sequences, chunk=chunk)
    if not (shape.sliding_window and _layer_counts(shape)[1]):
        return 0
    return max_sequences * window_blocks_per_sequence(shape.sliding_window, block_size, chunk)


def paged_pool(
    shape: KVShape,
    budget_bytes: int,
    block_size: int,
    dtype: str = "float16",
    *,
    max_sequences: int,
    chunk: int,
) -> tuple[int, int]:
    """(full-attention blocks, sliding-window blocks) of the pool a budget buys: the sliding layers
    get enough for `max_sequences` sequences at once, each in forwards of up to `chunk` tokens
    (`window_blocks_per_sequence`, so they never run short), the full layers every byte left."""
    _check_sizes(budget_bytes=budget_bytes, max_sequences=max_sequences, chunk=chunk)
    window = window_pool_blocks(shape, block_size, max_sequences=max_sequences, chunk=chunk)
    left = budget_bytes - window * window_block_bytes(shape, block_size, dtype)
    if left < 0:
        raise ValueError(
            f"a budget of {budget_bytes} bytes cannot hold the sliding layers' {window} blocks for "
            f"{max_sequences} sequences; raise the budget or lower the sequences"
        )
    full_bytes = paged_block_bytes(shape, block_size, dtype)
    return (left // full_bytes if full_bytes else 0), window


def paged_blocks_in_budget(shape: KVShape, budget_bytes: int, block_size: int, dtype: str = "float16") -> int:
    """Whole blocks of `block_size` tokens (every layer's keys and values) that fit in
    `budget_bytes`, for a shape whose every layer is full attention (else see `paged_pool`)."""
    _check_sizes(budget_bytes=budget_bytes)
    if _layer_counts(shape)[1]:
        raise ValueError("this shape has sliding-window layers: its pool is split (see paged_pool)")
    return budget_bytes // paged_block_bytes(shape, block_size, dtype)


def max_paged_sequences(
    shape: KVShape, budget_bytes: int, seq_len: int, block_size: int, dtype: str = "float16"
) -> int:
    """How many sequences of `seq_len` tokens fit in `budget_bytes` of a paged cache at once (no
    prefix shared): the budget over one sequence's paged bytes."""
    _check_sizes(budget_bytes=budget_bytes)
    if seq_len < 1:
        raise ValueError("a sequence of 0 tokens takes no block; give seq_len ≥ 1")
    return budget_bytes // paged_kv_cache_bytes(shape, seq_len, block_size, 1, dtype)


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """ "24GiB" -> 25769803776. Units: B, KB, MB, GB, TB (powers of 1000), KiB … TiB (1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read size {text!r}: expected a number and a unit such as 24GiB, 512MB, 1.5TB"
        )
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_bytes(count: float) -> str:
    """Bytes in binary units with 3 significant figures: 1536 -> '1.50 KiB'."""
    units = ["B", "KiB", "MiB", "GiB", "TiB"]
    exponent = 0
    while count >= 1024 and exponent < len(units) - 1:
        count /= 1024
        exponent += 1
    return f"{int(count)} B" if exponent == 0 else f"{count:.3g} {units[exponent]}"


def memory_table(
    shape: KVShape, lengths: Sequence[int], dtypes: Sequence[str], batch: int = 1
) -> list[dict[str, int]]:
    """Rows of {"tokens": T, dtype: bytes, …} for each length."""
    return [{"tokens": t, **{d: shape.bytes(t, batch, d) for d in dtypes}} for t in lengths]


def quantized_kv_cache_bytes(
    n_layers: int,
    n_heads: int,
    seq_len: int,
    head_dim: int,
    batch: int = 1,
    *,
    bits: int | str = 8,
    group_size: int = 64,
    residual_length: int = 128,
    dtype: str = "float16",
    scale_dtype: str | None = None,
    key_axis: str = "channel",
    value_axis: str = "token",
) -> int:
    """Bytes a quantized KV cache (`kvcache.cache.QuantizedCache`) holds after `seq_len` tokens.

    The first Q = floor((seq_len - residual_length) / group_size) · group_size tokens are packed
    (bits 8 or 4 per element, "fp8" one byte) with, per group, a scale and (integer kinds) a zero
    point of `scale_dtype` (default `dtype`); the other seq_len - Q tokens are in `dtype`. A
    group is `group_size` tokens of one channel (axis "channel") or min(group_size, head_dim)
    channels of one token (axis "token").
    """
    _check_sizes(
        n_layers=n_layers,
        n_heads=n_heads,
        seq_len=seq_len,
        head_dim=head_dim,
        batch=batch,
        group_size=group_size,
        residual_length=residual_length,
    )
    if bits not in (8, 4, "fp8") or isinstance(bits, bool):
        raise ValueError(f"bits must be 8, 4 or 'fp8', got {bits!r}")
    if group_size < 1:
        raise ValueError("group_size must be ≥ 1")
    if {key_axis, value_axis} - {"channel", "token"}:
        raise ValueError(f"axes must be 'channel' or 'token', got {key_axis!r}, {value_axis!r}")
    excess = seq_len - residual_length
    quantized = excess // group_size * group_size if excess >= group_size else 0
    params_per_group = 1 if bits == "fp8" else 2  # scale (and zero point)
    param_bytes = dtype_bits(scale_dtype or dtype) // 8 * params_per_group
    code_bits = 8 if bits == "fp8" else bits

    def packed(axis: str) -> int:
        if axis == "channel":
            groups = quantized // group_size * head_dim
        else:
            groups = quantized * (head_dim // min(group_size, head_dim))
        return quantized * head_dim * code_bits // 8 + groups * param_bytes

    residual = kv_cache_bytes(1, 1, seq_len - quantized, head_dim, 1, dtype)
    return n_layers * n_heads * batch * (packed(key_axis) + packed(value_axis) + residual)
