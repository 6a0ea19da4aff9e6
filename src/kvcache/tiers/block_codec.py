"""The bytes of one KV block in a shared store, and the namespace its key lives in.

A value is a fixed header and the raw tensor bytes, never a pickle:

    magic b"KVB3" | version u16 | keys' format u8 | values' format u8 | layers u16 | kv_heads u16 |
    head_dim u16 | value_dim u16 | block_size u16 | namespace 16 B | digest 16 B | checksum 16 B |
    keys | values

keys are (layers, block_size, kv_heads, head_dim) and values (layers, block_size, kv_heads,
value_dim), each in its stored format, little-endian: float32 (code 1), float16 (2), bfloat16 (3),
or a quantized pool's packed rows' bytes, (…, row bytes) (int8 4, int4 5, fp8 6;
`kvcache.cache.paged.formats`). Float values are checked finite; packed rows' float16 scales and
zero points too, and fp8 codes never NaN. The checksum is SHA-256 (its first 16 bytes) over the header
(checksum field zeroed) and the payload, chosen over blake2b for the CPU's SHA instructions,
since every byte read back is hashed before the request may use it. The digest is the block's
prefix hash chain, so a valid block copied under another block's key is refused too,
and the namespace (below) is inside the checksummed header, so a valid block another model wrote
(same geometry, other weights or dtype) copied under this model's key is refused as well.
A value read back is checked field by field before a byte of it is used (`decode_block` raises
`InvalidBlock`, which the engine counts and recomputes).

The key is `kvcache:<namespace>:<digest hex>`, the namespace a digest of everything that makes K/V
bytes valid for a model: its fingerprint (config and every weight byte), dtype, block size, layer
count and head geometry, and this format's version. Two models never share a namespace.
"""

from __future__ import annotations

import hashlib
import struct
import warnings
from dataclasses import dataclass

import torch

from kvcache.cache.paged.formats import row_format
from kvcache.memory import kv_dtype_pair, paged_kv_dtype, paged_row_bytes
from kvcache.model.fingerprint import model_fingerprint

MAGIC = b"KVB3"
VERSION = 3
_HEADER = struct.Struct("<4sHBBHHHHH16s16s16s")
_FORMATS = {"float32": 1, "float16": 2, "bfloat16": 3, "int8": 4, "int4": 5, "fp8": 6}  # one side's rows
_MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class InvalidBlock(ValueError):
    """A stored value that is not a block of this model's layout, or fails its checksum."""


@dataclass(frozen=True)
class BlockLayout:
    """What every block of one model in one pool looks like."""

    layers: int
    kv_heads: int
    head_dim: int
    value_dim: int
    block_size: int
    dtype: torch.dtype
    kv_dtype: str | None = None  # the pool's `PagedCache(kv_dtype=)`; None: rows in `dtype`

    @property
    def row_dtypes(self) -> tuple[str, str]:
        """What key rows and value rows are stored as ("bfloat16", "int8", …)."""
        return kv_dtype_pair(self.kv_dtype or str(self.dtype).removeprefix("torch."))

    @property
    def format_codes(self) -> tuple[int, int]:
        """The header's two format bytes: the keys' and the values'."""
        keys, values = self.row_dtypes
        return _FORMATS[keys], _FORMATS[values]

    @property
    def row_bytes(self) -> tuple[int, int]:
        """Bytes of one stored key row and one value row (one token's kv head)."""
        keys, values = self.row_dtypes
        return paged_row_bytes(self.head_dim, keys), paged_row_bytes(self.value_dim, values)

    @property
    def payload_bytes(self) -> int:
        rows = self.layers * self.block_size * self.kv_heads
        return rows * sum(self.row_bytes)

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value, header included."""
        return _HEADER.size + self.payload_bytes


def layout_of(model, block_size: int, kv_dtype: str | None = None) -> BlockLayout:
    """The block layout of `model`'s keys and values in blocks of `block_size` tokens, stored as
    `kv_dtype` says ("bfloat16", "int8", "int8/int4" …; None: in the model's dtype)."""
    config = model.config
    if model.dtype not in _MODEL_DTYPES:
        raise ValueError(f"a block store keeps float32, float16 or bfloat16 blocks, not {model.dtype}")
    if kv_dtype is not None and not paged_kv_dtype(kv_dtype):
        raise ValueError(f"a block store keeps rows of {tuple(_FORMATS)} (or a keys/values pair), "
                         f"not {kv_dtype!r}")
    return BlockLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.head_dim,
        block_size, model.dtype, kv_dtype,
    )


def namespace(model, layout: BlockLayout) -> str:
    """The store namespace of `model`'s blocks in `layout` (32 hex digits)."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(f"{model_fingerprint(model)}|{layout}|v{VERSION}".encode())
    return digest.hexdigest()


def block_key(space: str, digest: bytes) -> str:
    return f"kvcache:{space}:{digest.hex()}"


def _checksum(header: bytes, payload: bytes) -> bytes:
    digest = hashlib.sha256(header)
    digest.update(payload)
    return digest.digest()[:16]


def encode_block(
    layout: BlockLayout, space: str, digest: bytes, keys: torch.Tensor, values: torch.Tensor
) -> bytes:
    """One block's value: keys (layers, block_size, H_kv, D) and values (…, D_v) under `digest`, in
    namespace `space` (`namespace()`'s 32 hex digits)."""
    payload = b"".join(
        tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        for tensor in (keys, values)
    )
    fields = (MAGIC, VERSION, *layout.format_codes, layout.layers, layout.kv_heads, layout.head_dim,
              layout.value_dim, layout.block_size, bytes.fromhex(space), digest)
    header = _HEADER.pack(*fields, bytes(16))
    return _HEADER.pack(*fields, _checksum(header, payload)) + payload


def decode_block(
    layout: BlockLayout, space: str, digest: bytes, value: bytes
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys, values) of a value read back, each (layers, block_size, H_kv, D): raises
    `InvalidBlock` for a value of another size, format, layout, namespace or digest, a bad
    checksum, or non-finite numbers."""
    if not isinstance(value, bytes | bytearray | memoryview) or len(value) != layout.value_bytes:
        size = len(value) if isinstance(value, bytes | bytearray | memoryview) else type(value).__name__
        raise InvalidBlock(f"a block of this layout has {layout.value_bytes} bytes, got {size}")
    (magic, version, key_code, value_code, layers, heads, head_dim, value_dim, block_size, stored_space,
     stored_digest, checksum) = _HEADER.unpack_from(value)
    expected = (MAGIC, VERSION, *layout.format_codes, layout.layers, layout.kv_heads, layout.head_dim,
                layout.value_dim, layout.block_size, digest)
    found = (magic, version, key_code, value_code, layers, heads, head_dim, value_dim, block_size,
             stored_digest)
    if stored_space != bytes.fromhex(space):
        raise InvalidBlock(
            f"the block was written in namespace {stored_space.hex()}, not this model's {space} "
            "(another model's block, copied under this model's key)"
        )
    if found != expected:
        raise InvalidBlock(f"block header {found} does not match this model's {expected}")
    header = bytes(value[: _HEADER.size - 16]) + bytes(16)
    payload = memoryview(value)[_HEADER.size :]
    if _checksum(header, payload) != checksum:
        raise InvalidBlock("block checksum does not match its bytes")
    with warnings.catch_warnings():  # a view of the bytes read back, only ever read (never written)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(payload, dtype=torch.uint8)
    key_bytes = layers * block_size * heads * layout.row_bytes[0]
    sides = []
    for part, dtype, dim, width in zip((flat[:key_bytes], flat[key_bytes:]), layout.row_dtypes,
                                       (head_dim, value_dim), layout.row_bytes):
        stored = row_format(dtype, dim)
        if part.storage_offset() % stored.storage_dtype.itemsize:  # (values after keys of odd bytes)
            part = part.clone()
        rows = part.view(layers, block_size, heads, width).view(stored.storage_dtype)
        if not stored.valid(rows):
            raise InvalidBlock("block holds non-finite keys or values (or scales, fp8 NaN codes or "
                               "an fp8 row's zero that is not 0)")
        sides.append(rows)
    return sides[0], sides[1]
