"""A naive reference for the cache tests: the whole history, concatenated from scratch."""

from __future__ import annotations

import torch


class NaiveHistory:
    """Every token's k and v in position order, rebuilt with torch.cat on every change."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # (B, H, T, D)
        self.values: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        chunks_k = [] if self.keys is None else [self.keys]
        chunks_v = [] if self.values is None else [self.values]
        self.keys = torch.cat([*chunks_k, k], dim=2)
        self.values = torch.cat([*chunks_v, v], dim=2)

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = self.keys[:, :, :length].clone()
            self.values = self.values[:, :, :length].clone()

    def select(self, index: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None:
            self.keys = self.keys[index].clone()
            self.values = self.values[index].clone()


def expected_mask(
    query_positions: range, key_count: int, window: int | None
) -> torch.Tensor:
    """(T_new, key_count) bool: query q may see key position p iff p <= q (and p > q - window)."""
    mask = torch.zeros(len(query_positions), key_count, dtype=torch.bool)
    for row, q in enumerate(query_positions):
        low = 0 if window is None else max(0, q - window + 1)
        mask[row, low : q + 1] = True
    return mask


def check_step(
    layer_positions: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    history: NaiveHistory,
    window: int | None,
) -> None:
    """Check one update against the reference (after the reference appended the chunk).

    mask: (1, 1, T_new, T_kv); keys/values: what update returned. Each query must see exactly
    the positions of its (windowed) causal set, each once, holding the reference rows.
    """
    query_positions, key_positions = layer_positions
    assert history.keys is not None and history.values is not None
    new_tokens = mask.shape[2]
    past = history.length - new_tokens
    assert query_positions.tolist() == list(range(past, past + new_tokens))
    assert mask.shape[-1] == keys.shape[2] == values.shape[2] == key_positions.numel()
    want = expected_mask(range(past, history.length), history.length, window)
    for row in range(new_tokens):
        visible = mask[0, 0, row]
        seen = sorted(key_positions[visible].tolist())
        assert seen == torch.nonzero(want[row]).flatten().tolist(), (row, seen)
        for column in torch.nonzero(visible).flatten().tolist():
            position = int(key_positions[column])
            assert torch.equal(keys[:, :, column], history.keys[:, :, position])
            assert torch.equal(values[:, :, column], history.values[:, :, position])
