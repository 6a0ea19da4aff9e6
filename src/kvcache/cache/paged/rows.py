"""PagedCache rows: what a prompt's prefix would attach (`prefix_cost`), a row read out and put back
(its token ids and its keys and values per layer, in position order: `PagedCache.row_state` /
`load_row_state`, what prompt-cache files use), and the inputs that run new tokens on top of what
each row holds (`prefill_inputs`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvcache.blocks.allocator import ROOT_HASH

from ..errors import CacheShapeError, OutOfBlocksError


@dataclass
class RowState:
    """One row of a PagedCache read out: its token ids and, per layer, its keys (T, H_kv, D) and
    values (T, H_kv, D_v) in position order (T = len(token_ids))."""

    token_ids: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def _whole_rows_only(cache) -> None:
    if any(allocator.window is not None for allocator in cache.allocators):
        raise CacheShapeError(
            "this paged cache has sliding-window layers, whose rows hold only their window: a row "
            "cannot be read out or loaded whole"
        )


def read_row(cache, row: int) -> RowState:
    """Row `row`'s token ids and keys and values (copies, in position order). Every position
    it holds needs its token id declared (`add_sequence`, `declare_tokens`)."""
    _whole_rows_only(cache)
    seq = cache.sequence_id(row)
    state = cache.allocator.sequence(seq)
    tokens = state.num_tokens
    if tokens == 0:
        raise CacheShapeError(f"row {row} holds no tokens")
    if len(state.token_ids) < tokens:
        raise CacheShapeError(
            f"row {row} holds {tokens} tokens but only {len(state.token_ids)} token ids are "
            f"declared; declare them (declare_tokens) first"
        )
    slots = torch.tensor(cache.allocator.slots(seq, 0, tokens), dtype=torch.long, device=cache.device)
    read = [layer.read_slots(slots) for layer in cache.layers]
    return RowState(list(state.token_ids[:tokens]), [k for k, _ in read], [v for _, v in read])


def write_row(cache, state: RowState) -> int:
    """Add a row holding `state` (its full blocks hashed, so prompts that start with these
    tokens find them); return its index. Shapes, dtypes and free blocks are checked before
    anything is allocated or written (CacheShapeError, CacheDtypeError, OutOfBlocksError),
    so a refused state leaves the cache as it was."""
    _whole_rows_only(cache)
    tokens = len(state.token_ids)
    _check_rows(cache, state.keys, state.values, tokens)
    first_keys, first_values = state.keys[0], state.values[0]
    needed = cache.allocator.blocks_for(tokens)
    if needed > cache.allocator.num_allocatable:
        raise OutOfBlocksError(needed, cache.allocator.num_allocatable, cache.num_blocks)
    device = cache.device
    pool = (cache.num_blocks, cache.block_size)
    for layer in cache.layers:
        if not layer.allocated:  # a cache built without dtype: storage from the state
            layer.allocate(
                (*pool, *first_keys.shape[1:]), (*pool, *first_values.shape[1:]), first_keys.dtype, device
            )
    cache.add_sequence(state.token_ids, reuse_prefix=False)
    _append(cache, len(cache.rows) - 1, state.keys, state.values)
    return len(cache.rows) - 1


def append_to_row(cache, row: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
    """Write the next T positions of row `row` from keys (T, H_kv, D) and values (T, H_kv, D_v),
    one of each per layer, as a forward would have (keys and values computed elsewhere: a block
    store shared by replicas); the row's declared token ids for those positions make its full
    blocks findable. Returns the row's length after. Shapes, dtype and free blocks are checked
    first (CacheShapeError, CacheDtypeError, OutOfBlocksError): a refusal changes nothing. A
    sliding-window layer's positions the window has passed are written, then given back."""
    tokens = keys[0].shape[0] if keys and keys[0].dim() == 3 else 0
    _check_rows(cache, keys, values, tokens)
    seq = cache.sequence_id(row)
    held = cache.allocators[0].sequence(seq).num_tokens
    for allocator in cache.allocators:
        needed = allocator.blocks_for(held + tokens) - allocator.blocks_for(held)
        if needed > allocator.num_allocatable:
            raise OutOfBlocksError(needed, allocator.num_allocatable, allocator.num_blocks)
    _append(cache, row, keys, values)
    return held + tokens


def _check_rows(cache, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], tokens: int) -> None:
    """Raise a named error unless keys (T, H_kv, D) and values (T, H_kv, D_v), one of each per
    layer, hold the same `tokens` >= 1 rows and layout in every layer and fit the storage."""
    if tokens == 0 or len(keys) != len(cache.layers) or len(values) != len(cache.layers):
        raise CacheShapeError(
            f"rows need >= 1 token and keys and values for {len(cache.layers)} layers; got "
            f"{tokens} tokens, {len(keys)} keys, {len(values)} values"
        )
    first_keys, first_values = keys[0], values[0]
    for index, (layer, k, v) in enumerate(zip(cache.layers, keys, values)):
        if k.dim() != 3 or v.dim() != 3 or k.shape[0] != tokens or v.shape[0] != tokens:
            raise CacheShapeError(
                f"layer {index}: keys and values must be (tokens={tokens}, kv_heads, head_dim), got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
        if (k.shape[1:], v.shape[1:], k.dtype, v.dtype) != (
            first_keys.shape[1:], first_values.shape[1:], first_keys.dtype, first_values.dtype
        ):
            raise CacheShapeError(
                f"layer {index}: keys {tuple(k.shape)} {k.dtype} and values {tuple(v.shape)} "
                f"{v.dtype} differ from layer 0's {tuple(first_keys.shape)} {first_keys.dtype} and "
                f"{tuple(first_values.shape)} {first_values.dtype}"
            )
        layer.check_layout(k.shape[1], k.shape[2], v.shape[2], (k.dtype, v.dtype),
                           f"layer {index}'s keys and values")


def _append(cache, row: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """append_to_row after its checks (write_row checked its state itself)."""
    seq = cache.rows[row]
    held = cache.allocators[0].sequence(seq).num_tokens
    total = held + keys[0].shape[0]
    cache.reserve([row], [total])  # (a shared partial last block copied on write)
    for group, allocator in enumerate(cache.allocators):  # (full layers, then each window's)
        slots = torch.tensor(allocator.slots(seq, held, total), dtype=torch.long, device=cache.device)
        for layer, k, v in zip(cache.layers, keys, values):
            if layer.group == group:
                layer.write_slots(slots, k, v)
    cache.commit([row], [total])
    if cache.recent is not None:  # (rows as stored: no exact copy of them exists)
        cache.recent.skip(seq, total)


def prefill_inputs(cache, prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) that run `prompts` (one per row, the tokens not yet in the
    cache) on top of what each row holds: input_ids (B, T) left-padded, attention_mask
    (B, columns + T) with 1 for every held and new token, left-padded too."""
    columns = cache.get_seq_length()
    lengths = cache.row_lengths
    if len(prompts) != len(lengths):
        raise ValueError(f"{len(prompts)} prompts for a cache of {len(lengths)} rows")
    width = max(len(prompt) for prompt in prompts)
    if width == 0:
        raise ValueError("every prompt is empty: give each row at least one new token")
    device = cache.device
    input_ids = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
    attention_mask = torch.zeros((len(prompts), columns + width), dtype=torch.long, device=device)
    for row, (prompt, held) in enumerate(zip(prompts, lengths)):
        if not prompt:
            raise ValueError(f"prompt {row} is empty: each row needs at least one new token")
        input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, columns - held : columns] = 1
        attention_mask[row, columns + width - len(prompt) :] = 1
    return input_ids, attention_mask


def prefix_cost(
    cache, token_ids: Sequence[int], digests: Sequence[bytes] | None = None, root: bytes = ROOT_HASH,
    within_block: bool = True,
) -> tuple[int, int]:
    """(tokens `add_sequence` would attach, the full-attention blocks of those that no row uses
    now: attaching takes them from the blocks a new allocation may evict). Every group attaches
    the same tokens: the most whole blocks each can attach (a windowed group needs only the
    blocks inside the window of the last one), then, with within_block, the leading tokens of a
    cached block after them that every group holds (`BlockAllocator.partial_match`; copied on
    the first write, so it counts as a new block, not a held one, and not as one taken: it is
    released before its copy is allocated). digests:
    `prefix_digests(token_ids, root)` when the caller keeps them (they depend on the tokens
    only). Changes nothing, but reads the allocators' lists of blocks to match within: call it
    on the thread that changes the cache (the engine's step), unlike `attachable_blocks`."""
    if digests is None:
        digests = cache.prefix_digests(token_ids, root)
    limit = cache.reusable_tokens(len(token_ids))
    count = min(attachable_blocks(cache, digests), limit // cache.block_size)
    full = cache.full_allocator
    within = 0
    if within_block:
        within = min(group.partial_match(token_ids, digests, count, root)[1] for group in cache.allocators)
    within = min(within, limit - count * cache.block_size)
    return count * cache.block_size + within, 0 if full is None else full.idle_blocks(digests, count)


def attachable_blocks(cache, digests: Sequence[bytes]) -> int:
    """Leading blocks of `digests` every group of `cache` could attach now. Membership tests only,
    so safe to call beside a step on another thread (a stale count at worst)."""
    full = cache.full_allocator
    count = len(digests) if full is None else full.attachable(digests)
    while count and not all(allocator.can_attach(digests, count) for allocator in cache.allocators):
        count -= 1
    return count
