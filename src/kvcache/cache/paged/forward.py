"""Planning one forward of a PagedCache: reserve each row's blocks, then say where its new rows
go, which blocks each row reads, the new tokens' positions and the mask.

Rows may hold different numbers of tokens. Without an attention_mask every row appends all
T_new new tokens at its own length (the serving case: each sequence at its own position); with
one (B, columns + T_new), 0 marks padding columns, which are not stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcache.blocks.allocator import BlockAllocator

from ..base import ForwardPlan, LayerMasks
from ..errors import CacheConfigError, CacheShapeError
from ..masks import visible_keys
from .storage import Step


@dataclass
class ForwardLayout:
    """A planned forward: where rows go (`step`), the shared partial blocks to copy before any
    write (source, target), each new token's position (B, T_new) (0 for padding queries) and
    the mask (B or 1, 1, T_new, T_kv), None when every gathered key is visible to every query."""

    step: Step
    copies: list[tuple[int, int]]
    positions: torch.Tensor
    mask: torch.Tensor | None


def new_columns(
    allocator: BlockAllocator, rows: list[int], columns: int, new_tokens: int,
    attention_mask: torch.Tensor | None, device: torch.device,
) -> tuple[torch.Tensor | None, list[int]]:
    """One forward's new columns over `rows` (which are tokens (B, T_new) bool, None when all
    are; new tokens per row), the mask checked against the tokens the rows hold in `allocator`:
    the same in every group of a cache, whose rows hold the same positions. Raises
    `CacheShapeError` for a mask that does not describe the rows."""
    lengths = [allocator.sequence(seq).num_tokens for seq in rows]
    return _new_columns(lengths, columns, new_tokens, attention_mask, device)


def row_totals(allocator: BlockAllocator, rows: list[int], counts: list[int]) -> tuple[list[int], list[int]]:
    """(the tokens each of `rows` holds, and holds after a forward adding `counts`): what
    `plan_forward` reserves."""
    lengths = [allocator.sequence(seq).num_tokens for seq in rows]
    return lengths, [held + new for held, new in zip(lengths, counts)]


def plan_forward(
    allocator: BlockAllocator,
    rows: list[int],
    new_tokens: int,
    new: tuple[torch.Tensor | None, list[int]],
    device: torch.device,
    step_id: int,
) -> ForwardLayout:
    """Reserve the blocks of one forward of `new_tokens` columns over `rows` (allocator sequence
    ids, one per batch row) and lay it out; `new` is the forward's `new_columns`. Raises
    `OutOfBlocksError` (nothing reserved) when the pool is short; blocks reserved before (the
    engine's pool, `kvcache.engine.pool`) are not reserved again."""
    real, counts = new
    lengths, totals = row_totals(allocator, rows, counts)
    copies = allocator.reserve(rows, totals)
    firsts, visible = _read_span(allocator, lengths, totals)
    width = -(-visible // allocator.block_size)  # blocks per row in the gather
    first_block, read_blocks = _read_blocks(allocator, rows, firsts, width, device)
    write = [
        slot for seq, held, total in zip(rows, lengths, totals) for slot in allocator.slots(seq, held, total)
    ]
    write_slots = torch.tensor(write, dtype=torch.long, device=device)  # (N_real,)
    past = torch.tensor(lengths, device=device)[:, None]  # (B, 1)
    if real is None:
        source_rows = None
        query = past + torch.arange(new_tokens, device=device)  # (B, T_new)
    else:
        source_rows = real.flatten().nonzero().squeeze(1)  # (N_real,) row-major, as write
        query = (past + real.long().cumsum(1) - 1).masked_fill(~real, -1)  # (B, T_new)
    step = Step(
        step_id, new_tokens, len(rows), totals, write_slots, source_rows, read_blocks, first_block, visible,
        lengths, [first * allocator.block_size for first in firsts],
    )
    uniform = real is None and len(set(lengths)) == 1  # every row holds the same keys, all its columns real
    mask = _mask(allocator, firsts, visible, query, uniform, device)
    return ForwardLayout(step, copies, query.clamp(min=0), mask)


def _new_columns(
    lengths: list[int], columns: int, new_tokens: int, attention_mask: torch.Tensor | None, device
) -> tuple[torch.Tensor | None, list[int]]:
    """(which new columns are tokens (B, T_new) bool, None when all are; new tokens per row),
    from the attention mask, checked against the rows' `lengths`."""
    batch = len(lengths)
    if attention_mask is None:
        return None, [new_tokens] * batch
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, columns + new_tokens):
        raise CacheShapeError(
            f"attention_mask must be (batch, columns + new_tokens) = "
            f"({batch}, {columns + new_tokens}), got shape {tuple(attention_mask.shape)}"
        )
    given = attention_mask.to(device=device, dtype=torch.bool)
    held = given[:, :columns].sum(1).tolist()
    if held != lengths:
        raise CacheShapeError(
            f"attention_mask counts {held} earlier tokens per row; the cache holds "
            f"{lengths}: the mask must describe the tokens the cache holds"
        )
    real = given[:, columns:]  # (B, T_new)
    counts = real.sum(1).tolist()
    return (None if all(count == new_tokens for count in counts) else real), counts


def _read_span(allocator: BlockAllocator, lengths: list[int], totals: list[int]) -> tuple[list[int], int]:
    """(each row's first block read, keys gathered per row): from the first block without a
    window, else from the first block its earliest query's window reaches; at least one key
    (masked) even if every row is padding so far."""
    size, window = allocator.block_size, allocator.window
    if window is None:
        return [0] * len(lengths), max(1, *totals)
    firsts = [max(0, held - window + 1) // size for held in lengths]
    return firsts, max(max(1, total - first * size) for total, first in zip(totals, firsts))


def _read_blocks(
    allocator: BlockAllocator, rows: list[int], firsts: list[int], width: int, device
) -> tuple[int | None, torch.Tensor | None]:
    """(first block, None) for one row on `width` consecutive blocks, read in place; else (None,
    the blocks each row reads (B·width,)): a row shorter than the longest repeats a block of its
    own, or block 0 (masked)."""
    tables = [allocator.sequence(seq).table[first : first + width] for seq, first in zip(rows, firsts)]
    table = tables[0]
    if len(rows) == 1 and len(table) == width and table == list(range(table[0], table[0] + width)):
        return table[0], None
    padded = [block for table in tables for block in table + (table or [0])[:1] * (width - len(table))]
    return None, torch.tensor(padded, dtype=torch.long, device=device)


def _mask(
    allocator: BlockAllocator, firsts: list[int], visible: int, query: torch.Tensor, uniform: bool, device
) -> torch.Tensor | None:
    """The mask (B or 1, 1, T_new, T_kv) of queries at `query` (B, T_new) (-1: padding) over the
    gathered keys; None when every key is visible to every query. uniform: every row holds the
    same keys and every new column is a token."""
    window = allocator.window
    if window is not None:
        key_positions = torch.tensor(firsts, device=device)[:, None] * allocator.block_size + torch.arange(
            visible, device=device
        )
        keys, queries = key_positions[:, None, :], query[:, :, None]  # (B, 1, T_kv), (B, T_new, 1)
        allowed = visible_keys(queries, keys, window)  # (B, T_new, T_kv)
        allowed |= (queries < 0) & (torch.arange(visible, device=device) == 0)  # padding: its first key
        return allowed[:, None]  # (B, 1, T_new, T_kv)
    if uniform and query.shape[1] == 1:
        return None  # every row holds the same keys, all visible to its one new token
    key_positions = torch.arange(visible, device=device)  # (T_kv,)
    if uniform:
        return visible_keys(query[0][:, None], key_positions[None, :])[None, None]  # (1, 1, T_new, T_kv)
    # a key past the row's own length (right padding of a shorter row) lies past its queries, so
    # causality hides it
    allowed = visible_keys(query[:, :, None], key_positions[None, None, :])  # (B, T_new, T_kv)
    # a padding query sees key 0 of its row, so no row of the mask is empty (no NaN)
    allowed |= (query[:, :, None] < 0) & (key_positions == 0)
    return allowed[:, None]  # (B, 1, T_new, T_kv)


def check_windows(windows, kept: list[int | None]) -> None:
    """Raise `CacheConfigError` unless every layer the model windows (`windows`, one entry per
    layer, None = full attention) is kept within that window or a narrower one (`kept`): a paged
    cache lays its blocks out by window when it is built, so it cannot narrow a layer later."""
    for index, (wanted, window) in enumerate(zip(windows or (), kept)):
        if wanted is not None and (window is None or window > wanted):
            raise CacheConfigError(
                f"layer {index} of the model attends within a sliding window of {wanted}, but this "
                f"PagedCache keeps it {'whole' if window is None else f'in a window of {window}'}; "
                f"build the PagedCache with the model's config (config=model.config)"
            )


def group_mask(layout: ForwardLayout, new_tokens: int) -> torch.Tensor:
    """A layout's mask (B or 1, 1, T_new, T_kv); all True where its plan needs none."""
    if layout.mask is not None:
        return layout.mask
    return torch.ones(
        (1, 1, new_tokens, layout.step.visible), dtype=torch.bool, device=layout.positions.device
    )


def first_forward_plan(new_tokens: int, windows: list[int | None], device: torch.device) -> ForwardPlan:
    """The plan of a forward into an empty cache (its rows are made by the first update): each
    layer's keys are the new tokens, causal, within the layer's window where it has one."""
    positions = torch.arange(new_tokens, device=device)  # (T_new,)
    keys, queries = positions[None, :], positions[:, None]
    masks = [visible_keys(queries, keys, window) for window in windows]  # (T_new, T_new) each
    return ForwardPlan(LayerMasks([mask[None, None] for mask in masks]), positions=positions[None])
