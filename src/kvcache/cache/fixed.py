"""FixedCapacityLayer: the storage shared by the static and sliding layers (eager and compiled).

A buffer of `capacity` rows per (batch, kv head), allocated up front when every size is known,
otherwise by the first update (which then fixes batch, heads, dims, dtype and device). The length
is a Python int here; the compiled layers (`CompiledStaticLayer`, `CompiledSlidingWindowLayer`)
keep it in a tensor.
"""

from __future__ import annotations

import torch

from .errors import CacheConfigError, CacheDeviceError, CacheDtypeError, CacheShapeError
from .layer import CacheLayer, normal_tensors


class FixedCapacityLayer(CacheLayer):
    """A layer with a preallocated (B, H_kv, capacity, D) buffer; `_length` counts tokens seen."""

    def __init__(
        self,
        capacity: int,
        *,
        batch_size: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise CacheConfigError(f"capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._length = 0
        sizes = (batch_size, kv_heads, head_dim, dtype)
        if all(size is not None for size in sizes):
            assert batch_size is not None and kv_heads is not None and head_dim is not None
            shape = (batch_size, kv_heads, capacity, head_dim)
            self._allocate(shape, shape, dtype, torch.device(device or "cpu"))
        self._expected = (batch_size, kv_heads, head_dim, dtype, device)

    def _allocate(
        self,
        key_shape: tuple[int, int, int, int],
        value_shape: tuple[int, int, int, int],
        dtype: torch.dtype | None,
        device: torch.device,
    ) -> None:
        with normal_tensors():
            self._keys = torch.zeros(key_shape, dtype=dtype, device=device)  # (B, H_kv, C, D)
            self._values = torch.zeros(value_shape, dtype=dtype, device=device)  # (B, H_kv, C, D_v)

    def _check_and_allocate(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Validate k, v; on the first update, check them against given sizes and allocate."""
        self._check(k, v)
        if self._keys is not None:
            return
        batch, heads, head_dim, dtype, device = self._expected
        given = (k.shape[0], k.shape[1], k.shape[3], k.dtype)
        names = ("batch", "kv_heads", "head_dim", "dtype")
        for name, want, got in zip(names, (batch, heads, head_dim, dtype), given, strict=True):
            if want is not None and want != got:
                error = CacheDtypeError if name == "dtype" else CacheShapeError
                raise error(f"this layer was built for {name}={want}, k has {name}={got}")
        if device is not None and torch.device(device) != k.device:
            raise CacheDeviceError(f"this layer was built for device {device}, k is on {k.device}")
        key_shape = (k.shape[0], k.shape[1], self.capacity, k.shape[3])
        value_shape = (v.shape[0], v.shape[1], self.capacity, v.shape[3])
        self._allocate(key_shape, value_shape, k.dtype, k.device)

    def get_seq_length(self) -> int:
        """Tokens seen so far (absolute; a sliding layer counts evicted tokens too)."""
        return self._length

    def reset(self) -> None:
        """Forget every token; the buffer is kept."""
        self._length = 0

    def select(self, indices: torch.Tensor) -> None:
        """Keep batch rows `indices`; the buffer is re-allocated for the new batch."""
        super().select(indices)
        self._expected = (None, *self._expected[1:])

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times; the buffer is re-allocated for the new batch."""
        super().repeat_interleave(repeats)
        self._expected = (None, *self._expected[1:])
