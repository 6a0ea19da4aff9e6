"""A naive reference for the cache tests: the whole history, concatenated from scratch."""

from __future__ import annotations

import torch


class NaiveHistory:
    """Every token's k and v in position order, rebuilt with torch.cat on every change, and
    an HF-style attention mask (B, T), 1 = real token, 0 = padding."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # (B, H, T, D)
        self.values: torch.Tensor | None = None
        self.real: torch.Tensor | None = None  # (B, T) long

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, real: torch.Tensor | None = None) -> None:
        """Append k, v (B, H, T_new, D) and their mask columns real (B, T_new), default all 1."""
        if real is None:
            real = torch.ones(k.shape[0], k.shape[2], dtype=torch.long)
        chunks_k = [] if self.keys is None else [self.keys]
        chunks_v = [] if self.values is None else [self.values]
        chunks_r = [] if self.real is None else [self.real]
        self.keys = torch.cat([*chunks_k, k], dim=2)
        self.values = torch.cat([*chunks_v, v], dim=2)
        self.real = torch.cat([*chunks_r, real], dim=1)

    def crop(self, length: int) -> None:
        if self.keys is not None and self.values is not None and self.real is not None:
            self.keys = self.keys[:, :, :length].clone()
            self.values = self.values[:, :, :length].clone()
            self.real = self.real[:, :length].clone()

    def select(self, index: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None and self.real is not None:
            self.keys = self.keys[index].clone()
            self.values = self.values[index].clone()
            self.real = self.real[index].clone()


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
    padded: bool = False,
) -> None:
    """Check one update against the reference (after the reference appended the chunk).

    mask: (B or 1, 1, T_new, T_kv); keys/values: what update returned. Each query of each batch
    row must see exactly its (windowed) causal positions that are real tokens, plus its own
    position, each once, holding the reference rows. `padded`: the mask was built from
    history.real.
    """
    query_positions, key_positions = layer_positions
    assert history.keys is not None and history.values is not None and history.real is not None
    new_tokens = mask.shape[2]
    past = history.length - new_tokens
    assert query_positions.tolist() == list(range(past, past + new_tokens))
    assert mask.shape[-1] == keys.shape[2] == values.shape[2] == key_positions.numel()
    assert mask.shape[0] == (history.keys.shape[0] if padded else 1)
    want = expected_mask(range(past, history.length), history.length, window)
    for batch in range(mask.shape[0]):
        real = history.real[batch].bool() if padded else torch.ones(history.length, dtype=bool)
        for row in range(new_tokens):
            visible = mask[batch, 0, row]
            seen = sorted(key_positions[visible].tolist())
            allowed = want[row] & real
            allowed[past + row] = True  # a query always sees itself
            assert seen == torch.nonzero(allowed).flatten().tolist(), (batch, row, seen)
            for column in torch.nonzero(visible).flatten().tolist():
                position = int(key_positions[column])
                rows = slice(None) if mask.shape[0] == 1 else slice(batch, batch + 1)
                assert torch.equal(keys[rows, :, column], history.keys[rows, :, position])
                assert torch.equal(values[rows, :, column], history.values[rows, :, position])
