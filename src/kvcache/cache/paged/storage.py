"""The block storage of PagedCache: where one forward's rows go (`Step`), writing them to their
slots and gathering each row's visible keys or values, and gathering whole rows by slot.

Storage is one tensor per layer and kind, (num_blocks, block_size, H_kv, D); slot s is row
s % block_size of block s // block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Step:
    """Where one forward's rows go, computed once and used by every layer's update."""

    step_id: int
    new_tokens: int  # T_new, columns of this forward
    batch: int
    totals: list[int]  # tokens per row after this forward
    write_slots: torch.Tensor  # (N_real,) slot of each stored new token, row-major
    source_rows: torch.Tensor | None  # (N_real,) index into the (B·T_new) new rows; None = all
    read_blocks: torch.Tensor | None  # (B·n,) blocks each row attends to, padded per row
    first_block: int | None  # one row on consecutive blocks: they start here (no gather)
    visible: int  # T_kv = max(totals)
    starts: list[int]  # tokens per row before this forward
    read_from: list[int]  # the position of each row's first gathered key
    pending: bool = True  # layer 0 has not written it yet


def write_and_gather(storage: torch.Tensor, new: torch.Tensor, step: Step) -> torch.Tensor:
    """Write new (B, H_kv, T_new, D) to its slots of storage (blocks, S, H_kv, D); return each
    row's visible rows (B, H_kv, T_kv, D): a view for one row on consecutive blocks, else a
    gather."""
    batch, heads, new_tokens, dim = new.shape
    blocks, size = storage.shape[:2]
    rows = new.transpose(1, 2).reshape(batch * new_tokens, heads, dim)  # (B·T_new, H_kv, D)
    if step.source_rows is not None:
        rows = rows.index_select(0, step.source_rows)  # (N_real, H_kv, D)
    storage.view(blocks * size, heads, dim).index_copy_(0, step.write_slots, rows)
    if step.read_blocks is None:  # consecutive blocks: a view
        width = -(-step.visible // size)
        gathered = storage.narrow(0, step.first_block, width)  # (n, S, H_kv, D)
    else:
        gathered = torch.index_select(storage, 0, step.read_blocks)  # (B·n, S, H_kv, D)
    gathered = gathered.view(batch, -1, heads, dim).narrow(1, 0, step.visible)  # (B, T_kv, H_kv, D)
    return gathered.transpose(1, 2)  # (B, H_kv, T_kv, D)


def gather_rows(storage: torch.Tensor, slots: list[list[int]]) -> torch.Tensor:
    """Rows (B, H_kv, T, D) read from storage (blocks, S, H_kv, D) at each row's slots, right-padded
    with zeros to the longest row (T = its length)."""
    lengths = [len(row) for row in slots]
    visible = max(lengths)
    index = torch.tensor(
        [row + [0] * (visible - len(row)) for row in slots], dtype=torch.long, device=storage.device
    )  # (B, T)
    rows = storage.view(-1, *storage.shape[2:]).index_select(0, index.flatten())
    rows = rows.view(len(lengths), visible, *storage.shape[2:])  # (B, T, H_kv, D)
    filled = torch.arange(visible, device=storage.device)[None, :] < torch.tensor(
        lengths, device=storage.device
    )[:, None]  # (B, T)
    return (rows * filled[:, :, None, None]).transpose(1, 2)  # (B, H_kv, T, D)
