"""The engine's KV pool: one PagedCache sized from a byte budget as `kvcache.memory` sizes it."""

from __future__ import annotations

from kvcache.cache import PagedCache
from kvcache.engine.params import RequestError
from kvcache.engine.scheduler import Limits
from kvcache.geometry import read_geometry
from kvcache.memory import KVShape, paged_block_bytes, paged_pool, parse_size, window_pool_blocks


def build_pool(
    model, limits: Limits, kv_budget: int | str | None, num_blocks: int | None
) -> tuple[PagedCache, int]:
    """The PagedCache for `model` and the bytes of one full-attention block.

    kv_budget: bytes (an int, or "256MiB") for keys and values: the sliding layers get enough
    blocks for `limits.max_running` rows of any length, the full layers as many whole blocks as
    the rest holds (`kvcache.memory.paged_pool`). num_blocks: the full layers' size in blocks
    instead. Raises RequestError for a budget that holds no block."""
    shape = KVShape.from_geometry(read_geometry(model.config))
    dtype_name = str(model.dtype).removeprefix("torch.")
    block_bytes = paged_block_bytes(shape, limits.block_size, dtype_name)
    budget = 0
    if num_blocks is None:
        budget = parse_size(kv_budget) if isinstance(kv_budget, str) else kv_budget
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < block_bytes:
            raise RequestError(
                f"kv_budget must hold at least one block of {block_bytes} bytes, got {kv_budget!r}"
            )
    elif not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
        raise RequestError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    sizes = dict(max_sequences=limits.max_running, chunk=limits.token_budget)
    try:
        if num_blocks is not None:  # the full layers' size given: the sliding layers' as always
            full, window = num_blocks, window_pool_blocks(shape, limits.block_size, **sizes)
        else:
            full, window = paged_pool(shape, budget, limits.block_size, dtype_name, **sizes)
    except ValueError as error:
        raise RequestError(str(error)) from None
    pool = PagedCache(
        num_blocks if num_blocks is not None else max(full, 1),
        limits.block_size,
        window_blocks=window or None,
        config=model.config,
        dtype=model.dtype,
        device=model.device,
    )
    return pool, block_bytes
