"""CacheLayer: what every layer kind answers (its length, the absolute positions of the rows it
will return, its visible keys and values) and the checks and batch operations they share."""

from __future__ import annotations

import contextlib
from collections.abc import Hashable

import torch

from .arrays import array_of
from .checks import check_batch_index, check_crop, check_kv_pair, where
from .errors import CacheDeviceError, CacheDtypeError, CacheShapeError


def is_compiling() -> bool:
    """True while torch.compile traces the code (then no Python int may track the length)."""
    return torch.compiler.is_compiling()


def normal_tensors():
    """The context every cache storage tensor is made in: outside inference mode, so a cache
    filled under `torch.inference_mode()` (as `generate` runs) can still be written after it
    (crop, reset, another forward with or without no_grad). A normal tensor may be written in
    place inside inference mode; an inference tensor may not be written outside it."""
    return contextlib.nullcontext() if is_compiling() else torch.inference_mode(False)


class CacheLayer:
    """Keys and values of one attention layer, stored as (B, H_kv, T, D) after RoPE.

    Subclasses implement `update`, `get_seq_length`, `mask_key`, `mask_positions`, the
    `keys`/`values` views and `crop`. Storage is allocated lazily by the first update unless a
    subclass was given every size up front.
    """

    #: a query at q sees keys in (q - window, q]; None = plain causal.
    window: int | None = None

    def __init__(self) -> None:
        self.layer_idx: int | None = None  # set by Cache, only for error messages
        self._keys: torch.Tensor | None = None  # (B, H_kv, capacity, D)
        self._values: torch.Tensor | None = None  # (B, H_kv, capacity, D_v)
        self._forget_arrays()

    # ---- the seam -------------------------------------------------------------------------
    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (B, H_kv, T_new, D) and return K, V (B, H_kv, T_visible, D) to attend."""
        raise NotImplementedError

    def get_seq_length(self) -> int:
        """Tokens this layer has seen so far (absolute, including evicted ones)."""
        raise NotImplementedError

    def start_position(self) -> int | torch.Tensor:
        """Where the next token sits: `get_seq_length()`, or a 0-d tensor for a layer that keeps
        its length in one (compiled layers), so compiled code never reads a Python int."""
        return self.get_seq_length()

    def mask_key(self, new_tokens: int) -> Hashable:
        """A key equal for two layers exactly when their masks for this chunk are equal."""
        raise NotImplementedError

    # ---- numpy views of the buffers, for kernels that read them in place ----------------------
    def _forget_arrays(self) -> None:
        """Drop the numpy views of the buffers (taken again when next needed)."""
        self._arrays: tuple | None = None  # (keys, values) numpy views of the whole buffers
        self._arrays_of: tuple = ()  # (keys, values, their data pointers) they were taken from

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)  # a copy or a pickle takes views again, of its own buffers
        state["_arrays"], state["_arrays_of"] = None, ()
        return state

    def _buffer_arrays(self):
        """(keys, values) numpy views of the whole buffers (bfloat16 as its bits, uint16), or
        None (none yet, not on CPU, a dtype numpy lacks); taken again whenever a buffer was
        replaced (growth, select, …) or its memory moved (the buffers are checked by identity
        and data pointer)."""
        keys, values = self._keys, self._values
        if keys is None or values is None:
            return None
        taken = self._arrays_of
        if (
            not taken
            or taken[0] is not keys
            or taken[1] is not values
            or taken[2] != keys.data_ptr()
            or taken[3] != values.data_ptr()
        ):
            self._arrays = None
            self._arrays_of = (keys, values, keys.data_ptr(), values.data_ptr())
            if keys.device.type == "cpu":
                try:
                    self._arrays = (array_of(keys), array_of(values))
                except (TypeError, RuntimeError):  # a dtype numpy lacks, or a tensor that needs grad
                    self._arrays = None
        return self._arrays

    def sees_every_key(self, new_tokens: int) -> bool:
        """Whether, with no padding, every key the next update returns is visible to all of the
        `new_tokens` queries (its mask would be all True). False unless a layer kind knows;
        a caller may then skip building the mask."""
        return False

    def mask_positions(
        self, new_tokens: int, device: torch.device | str | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions for the next update of `new_tokens` rows, asked before that update.

        Returns (query_positions (T_new,), key_positions (T_kv,)) long tensors, where T_kv is the
        length of K the next update returns and -1 marks a key slot that holds no token.
        """
        raise NotImplementedError

    @property
    def keys(self) -> torch.Tensor | None:
        """The visible keys (B, H_kv, T, D) in position order; None before the first update."""
        raise NotImplementedError

    @property
    def values(self) -> torch.Tensor | None:
        """The visible values (B, H_kv, T, D_v) in position order; None before the first update."""
        raise NotImplementedError

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens (a no-op if fewer are held)."""
        raise NotImplementedError

    def validate_crop(self, max_length: int) -> None:
        """Raise `CacheCropError` if `crop(max_length)` is impossible; change nothing."""
        check_crop(max_length)

    def reset(self) -> None:
        """Forget every token; allocated storage is kept for reuse."""
        raise NotImplementedError

    # ---- shared -----------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        """Device of the stored tensors, None before allocation."""
        return None if self._keys is None else self._keys.device

    @property
    def batch_size(self) -> int | None:
        """Batch size of the stored tensors, None before allocation."""
        return None if self._keys is None else self._keys.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes allocated for keys and values (capacity, not just the rows in use)."""
        if self._keys is None or self._values is None:
            return 0
        return self._keys.nbytes + self._values.nbytes

    @property
    def nbytes_used(self) -> int:
        """Bytes of the rows that hold live tokens: B × H_kv × T_held × (D + D_v) × itemsize."""
        if self._keys is None or self._values is None:
            return 0
        capacity = self._keys.shape[2]
        per_row = (self._keys.nbytes + self._values.nbytes) // capacity
        return self._rows_held() * per_row

    def _rows_held(self) -> int:
        """Rows of storage that hold live tokens."""
        raise NotImplementedError

    def _check(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise a named error unless k, v fit each other and what is stored."""
        stored, stored_values = self._keys, self._values
        if stored is not None and stored_values is not None and type(k) is type(v) is torch.Tensor:
            # fast path of the decode loop: one pass of comparisons, no messages built
            ks, vs, sk, sv = k.shape, v.shape, stored.shape, stored_values.shape
            if (
                len(ks) == 4
                and len(vs) == 4
                and ks[0] == vs[0] == sk[0]
                and ks[1] == vs[1] == sk[1]
                and ks[2] == vs[2] >= 1
                and ks[3] == sk[3]
                and vs[3] == sv[3]
                and k.dtype == v.dtype == stored.dtype
                and k.device == v.device == stored.device
            ):
                return
        check_kv_pair(k, v, self.layer_idx)
        stored = self._keys
        if stored is None or self._values is None:
            return
        place = where(self.layer_idx)
        if k.shape[0] != stored.shape[0] or k.shape[1] != stored.shape[1]:
            raise CacheShapeError(
                f"k{place} has batch {k.shape[0]} and {k.shape[1]} kv heads; the cache holds "
                f"batch {stored.shape[0]} and {stored.shape[1]} kv heads"
            )
        if k.shape[3] != stored.shape[3] or v.shape[3] != self._values.shape[3]:
            raise CacheShapeError(
                f"k, v{place} have head dims {k.shape[3]}, {v.shape[3]}; the cache holds "
                f"{stored.shape[3]}, {self._values.shape[3]}"
            )
        if k.dtype != stored.dtype or v.dtype != stored.dtype:
            raise CacheDtypeError(
                f"k, v{place} have dtypes {k.dtype}, {v.dtype}; the cache stores {stored.dtype}"
            )
        if k.device != stored.device or v.device != stored.device:
            raise CacheDeviceError(
                f"k, v{place} are on {k.device}, {v.device}; the cache is on {stored.device}"
            )

    def select(self, indices: torch.Tensor) -> None:
        """Keep the batch rows `indices` (1-D long, in that order, repeats allowed)."""
        self._forget_arrays()  # new buffers: views of the old ones would keep them alive
        if self._keys is None or self._values is None:
            return
        index = check_batch_index(indices, self._keys.shape[0], self._keys.device)
        with normal_tensors():
            self._keys = self._keys.index_select(0, index)  # (B', H_kv, capacity, D)
            self._values = self._values.index_select(0, index)  # (B', H_kv, capacity, D_v)

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each batch row `repeats` times in place (B → B × repeats), e.g. for beams."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheShapeError(f"repeats must be an int >= 1, got {repeats!r}")
        self._forget_arrays()
        if self._keys is None or self._values is None:
            return
        with normal_tensors():
            self._keys = self._keys.repeat_interleave(repeats, dim=0)  # (B·r, H_kv, capacity, D)
            self._values = self._values.repeat_interleave(repeats, dim=0)  # (B·r, H_kv, cap, D_v)
