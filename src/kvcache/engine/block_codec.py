"""The bytes of one KV block in a shared store, and the namespace its key lives in.

A value is a fixed header and the raw tensor bytes, never a pickle:

    magic b"KVB2" | version u16 | dtype u8 | pad u8 | layers u16 | kv_heads u16 | head_dim u16 |
    value_dim u16 | block_size u16 | namespace 16 B | digest 16 B | checksum 16 B | keys | values

keys are (layers, block_size, kv_heads, head_dim) and values (layers, block_size, kv_heads,
value_dim), in the stored dtype, little-endian. The checksum is SHA-256 (its first 16 bytes) over
the header (checksum field zeroed) and the payload, chosen over blake2b for the CPU's SHA
instructions, since every byte read back is hashed before the request may use it. The digest is
the block's prefix hash chain, so a valid block copied under another block's key is refused too,
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
import math
import struct
import warnings
from dataclasses import dataclass

import torch

from kvcache.model.fingerprint import model_fingerprint

MAGIC = b"KVB2"
VERSION = 2
_HEADER = struct.Struct("<4sHBBHHHHH16s16s16s")
_DTYPES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
_BY_CODE = {code: dtype for dtype, code in _DTYPES.items()}


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

    @property
    def payload_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        rows = self.layers * self.block_size * self.kv_heads
        return rows * (self.head_dim + self.value_dim) * item

    @property
    def value_bytes(self) -> int:
        """Bytes of one stored value, header included."""
        return _HEADER.size + self.payload_bytes


def layout_of(model, block_size: int) -> BlockLayout:
    """The block layout of `model`'s keys and values in blocks of `block_size` tokens."""
    config = model.config
    if model.dtype not in _DTYPES:
        raise ValueError(f"a block store keeps float32, float16 or bfloat16 blocks, not {model.dtype}")
    return BlockLayout(
        config.num_hidden_layers, config.num_key_value_heads, config.head_dim, config.head_dim,
        block_size, model.dtype,
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
    fields = (MAGIC, VERSION, _DTYPES[layout.dtype], 0, layout.layers, layout.kv_heads, layout.head_dim,
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
    (magic, version, dtype, _, layers, heads, head_dim, value_dim, block_size, stored_space,
     stored_digest, checksum) = _HEADER.unpack_from(value)
    expected = (MAGIC, VERSION, _DTYPES[layout.dtype], layout.layers, layout.kv_heads, layout.head_dim,
                layout.value_dim, layout.block_size, digest)
    found = (magic, version, dtype, layers, heads, head_dim, value_dim, block_size, stored_digest)
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
        flat = torch.frombuffer(payload, dtype=_BY_CODE[dtype])
    # one pass, nothing allocated: a float64 sum of float32 or half values cannot overflow, and
    # is finite exactly when every element is
    if not math.isfinite(float(flat.sum(dtype=torch.float64))):
        raise InvalidBlock("block holds non-finite keys or values")
    rows = layers * block_size * heads
    keys = flat[: rows * head_dim].view(layers, block_size, heads, head_dim)
    values = flat[rows * head_dim :].view(layers, block_size, heads, value_dim)
    return keys, values
