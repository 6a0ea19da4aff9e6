"""The full-precision window of a PagedCache stored in a kv_dtype (`PagedCache(kv_window=W)`):
each row's last W positions are kept a second time in the forward's dtype, and every read of
those positions (the seam's gathers, the kernels' attention) reads them from here instead of
from their blocks. The blocks stay as they are (each row written once, quantized when its token
is), so prefix sharing, the tiers and prompt-cache files are unchanged.

Which positions are exact is decided per forward: those at or after `total - W`, where total is
the row's length after the forward, and only those the row wrote itself. What a forward reads
is exact there; what reads a row out as stored (the `keys` / `values` properties, `row_state`,
the block store) reads its blocks. A prefix attached from the cache, rows loaded from a store or
a prompt-cache file, come as stored: their float rows never existed here, so a hit stops before
a prompt's last W tokens (`PagedCache.reusable_tokens`). So a decode step reads
the current token and the W - 1 before it exactly; a prompt chunk reads its own last W positions
exactly and the rest as stored.

Storage: per layer, keys (capacity·W·H_kv, D) and values (…, D_v) in the forward's dtype; row
seq's position p, kv head h at row (slot(seq)·W + p % W)·H_kv + h. A slot per live row (a freed
row's slot reused), grown when more rows are live than ever before.
"""

from __future__ import annotations

import torch

from ..errors import CacheConfigError
from ..layer import normal_tensors
from .storage import Step


def checked_window(kv_window: int, kv_dtype: str | None) -> int:
    """kv_window as an int >= 0; CacheConfigError for a bad value or a window without a kv_dtype
    (rows stored as computed have nothing to keep exact)."""
    if isinstance(kv_window, bool) or not isinstance(kv_window, int) or kv_window < 0:
        raise CacheConfigError(f"kv_window must be an int >= 0 (tokens), got {kv_window!r}")
    if kv_window and kv_dtype is None:
        raise CacheConfigError(
            "kv_window keeps the last tokens in the forward's dtype beside rows stored in a kv_dtype; "
            "this cache has no kv_dtype (its rows are stored as computed)"
        )
    return kv_window


class RecentRows:
    """Each live row's last `window` positions in the forward's dtype (see the module docstring).
    Rows are the PagedCache's sequence ids."""

    def __init__(self, window: int, num_layers: int) -> None:
        self.window = window
        self._slots: dict[int, int] = {}  # sequence id -> its slot
        self._first: dict[int, int] = {}  # sequence id -> first position it wrote here
        self._free: list[int] = []
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # (capacity, W, H_kv, D)
        self.values: list[torch.Tensor | None] = [None] * num_layers  # (capacity, W, H_kv, D_v)

    # ---- rows come and go ----------------------------------------------------------------------
    def add(self, seq: int, held: int) -> None:
        """A row that holds `held` positions it did not compute here (an attached prefix)."""
        self._slots[seq] = self._free.pop() if self._free else len(self._slots) + len(self._free)
        self._first[seq] = held

    def fork(self, parent: int, child: int) -> None:
        """`child` holds what `parent` holds, its exact rows copied."""
        self.add(child, self._first[parent])
        self._grow(len(self._slots) + len(self._free))
        source, target = self._slots[parent], self._slots[child]
        for stored in (*self.keys, *self.values):
            if stored is not None:
                stored[target].copy_(stored[source])

    def free(self, seq: int) -> None:
        """Forget row `seq` (its slot is reused)."""
        self._free.append(self._slots.pop(seq))
        del self._first[seq]

    def truncate(self, seq: int, held: int, keep: int) -> None:
        """Row `seq`, which held `held` positions, now holds `keep` <= held: the positions its slot
        holds stay exact (those before held - W were never there)."""
        self._first[seq] = min(keep, max(self._first[seq], held - self.window))

    def skip(self, seq: int, total: int) -> None:
        """Row `seq`'s positions before `total` were written from elsewhere (as stored)."""
        self._first[seq] = total

    # ---- reads and writes ----------------------------------------------------------------------
    def exact_from(self, seq: int, total: int) -> int:
        """The first position of row `seq` (holding `total`) read from here."""
        return max(self._first[seq], total - self.window)

    def base(self, seq: int) -> int:
        """Row `seq`'s first storage row: position p's kv head h is at base + (p % W)·H_kv + h."""
        kv_heads = 0 if self.keys[0] is None else self.keys[0].shape[2]
        return self._slots[seq] * self.window * kv_heads

    def write(self, layer: int, seq: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Keep row `seq`'s new keys (T, H_kv, D) and values (T, H_kv, D_v) at positions start ..
        start + T - 1 (its length after: start + T): those within the last W positions."""
        total = start + keys.shape[0]
        begin = max(start, total - self.window)
        if begin >= total:
            return
        self.prepare(layer, keys.shape[1], keys.shape[2], values.shape[2], keys.dtype, keys.device)
        slot, places = self._slots[seq], torch.arange(begin, total) % self.window
        stored_keys, stored_values = self.keys[layer], self.values[layer]
        assert stored_keys is not None and stored_values is not None
        stored_keys[slot].index_copy_(0, places, keys[begin - start :].to(stored_keys.dtype))
        stored_values[slot].index_copy_(0, places, values[begin - start :].to(stored_values.dtype))

    def read(self, layer: int, seq: int, total: int) -> tuple[range, torch.Tensor, torch.Tensor]:
        """(positions, keys (n, H_kv, D), values (n, H_kv, D_v)) of row `seq`'s exact positions
        when it holds `total`."""
        positions = range(self.exact_from(seq, total), total)
        stored_keys, stored_values = self.keys[layer], self.values[layer]
        if not positions or stored_keys is None or stored_values is None:
            return range(0), torch.empty(0), torch.empty(0)
        places = torch.arange(positions.start, positions.stop) % self.window
        slot = self._slots[seq]
        return positions, *(stored[slot].index_select(0, places) for stored in (stored_keys, stored_values))

    def kernel_storage(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer `layer`'s keys (capacity·W·H_kv, D) and values (…, D_v) as the kernels read
        them (None before its first write)."""
        keys, values = self.keys[layer], self.values[layer]
        if keys is None or values is None:
            return None
        return keys.view(-1, keys.shape[-1]), values.view(-1, values.shape[-1])

    def prepare(
        self, layer: int, kv_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device=None,
        rows: int = 1,
    ) -> None:
        """Allocate layer `layer`'s storage (kv_heads of key_dim, value_dim in `dtype`, on `device`)
        for every live row and at least `rows` rows, before the kernels write into it."""
        if self.keys[layer] is None:
            capacity = max(rows, len(self._slots) + len(self._free))
            shape = (capacity, self.window, kv_heads)
            with normal_tensors():
                self.keys[layer] = torch.zeros((*shape, key_dim), dtype=dtype, device=device)
                self.values[layer] = torch.zeros((*shape, value_dim), dtype=dtype, device=device)
        self._grow(len(self._slots) + len(self._free))

    def _grow(self, slots: int) -> None:
        """Every allocated layer's storage holds at least `slots` slots: exactly that many, so its
        bytes are those of the most rows ever live at once (what the engine budgets for), the
        copy paid once per new high."""
        for stores in (self.keys, self.values):
            for index, stored in enumerate(stores):
                if stored is not None and stored.shape[0] < slots:
                    with normal_tensors():
                        grown = stored.new_zeros((slots, *stored.shape[1:]))
                    grown[: stored.shape[0]] = stored
                    stores[index] = grown

    @property
    def nbytes(self) -> int:
        """Bytes held over all layers (every slot, used or free)."""
        return sum(t.nbytes for t in (*self.keys, *self.values) if t is not None)


def put_exact_rows(
    recent: RecentRows, layer: int, seqs: list[int], step: Step, new: tuple[torch.Tensor, torch.Tensor],
    gathered: tuple[torch.Tensor | None, torch.Tensor | None],
) -> None:
    """The seam's part of the window for one layer's forward (`step`, over rows `seqs`): keep
    each row's new keys and values (`new`: (B, H_kv, T_new, D), (…, D_v), padding columns
    included, as the forward gave them), then overwrite each row's exact positions in its
    `gathered` keys and values (B, H_kv, T_kv, D), (…, D_v), in place (a side given as None is
    left: read in the forward's dtype already, as the storage itself)."""
    batch, heads, new_tokens, _ = new[0].shape
    flat = [rows.transpose(1, 2).reshape(batch * new_tokens, heads, rows.shape[3]) for rows in new]
    if step.source_rows is not None:  # (the real tokens only, row-major)
        flat = [rows.index_select(0, step.source_rows) for rows in flat]
    offset = 0
    for row, seq in enumerate(seqs):
        start, total = step.starts[row], step.totals[row]
        recent.write(layer, seq, start, flat[0][offset : offset + total - start],
                     flat[1][offset : offset + total - start])
        offset += total - start
        positions, keys, values = recent.read(layer, seq, total)
        first = max(positions.start, step.read_from[row]) if positions else total
        if first < total:
            at = slice(first - step.read_from[row], total - step.read_from[row])
            skip = first - positions.start
            for target, exact in zip(gathered, (keys, values)):
                if target is not None:
                    target[row, :, at] = exact[skip:].transpose(0, 1).to(target.dtype)
