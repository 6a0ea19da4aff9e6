"""The engine's step on numba's kernels: every row of a `PagedBatch` (decode rows and prompt chunks
alike) in one pass over the weights, attention reading the paged blocks in place.

The design, the reasons and the measurements behind them: `docs/backends.md`, Module notes,
paged_step.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvcache.backends.cpu import numba_products
from kvcache.backends.cpu.threads import torch_threads
from kvcache.cache.arrays import array_of, tensor_of
from kvcache.cache.masks import visible_keys

_NO_MASK = np.empty(0, np.bool_)  # the kernels' "every key the layout allows"


@dataclass
class TokenRows:
    """A batch's new tokens as the kernels' N rows."""

    ids: np.ndarray  # (N,) token ids
    positions: np.ndarray  # (N,)
    table_row: np.ndarray  # (N,) int64: each token's batch row (its row of the block tables)
    lengths: np.ndarray  # (N,) int64: the keys each token sees, its position + 1
    last: np.ndarray  # (S,) the token indices whose logits are wanted (`PagedBatch.wanted`)
    groups: list[tuple[np.ndarray, np.ndarray]]  # per group of layers: (tables (R, W), slots (N,))
    firsts: np.ndarray  # (R,) each batch row's first token index
    counts: np.ndarray  # (R,) each batch row's tokens

    @property
    def singles(self) -> np.ndarray:
        """Token indices of the rows that run one token (decoding)."""
        return self.firsts[self.counts == 1]


def token_rows(batch) -> TokenRows:
    """`batch`'s tokens laid out for the kernels, with every group's block tables and slots."""
    cache = batch.cache
    counts = np.array([len(tokens) for tokens in batch.tokens])
    ids = np.fromiter((token for tokens in batch.tokens for token in tokens), np.int64, int(counts.sum()))
    table_row = np.repeat(np.arange(len(counts)), counts)
    firsts = np.cumsum(counts) - counts  # each row's first token index
    positions = np.arange(len(ids)) - np.repeat(firsts, counts) + np.repeat(batch.starts, counts)
    size = cache.block_size
    groups = []
    for allocator in cache.allocators:
        held = [allocator.sequence(cache.rows[row]).table for row in batch.rows]
        tables = np.zeros((len(held), max(map(len, held))), np.int64)  # (holes before windows: 0, never read)
        for row, table in enumerate(held):
            tables[row, : len(table)] = np.maximum(table, 0)
        slots = tables[table_row, positions // size] * size + positions % size
        groups.append((tables, slots))
    last = np.array([firsts[row] + index for row, index in batch.wanted], np.int64)
    return TokenRows(ids, positions, table_row, positions + 1, last, groups, firsts, counts)


def run(step, batch) -> torch.Tensor:
    """(wanted tokens, vocab) float32 logits of one engine step of `step` (an `CpuBackend` whose
    `row_layers` are set) over `batch`, every row's keys and values written to its slots."""
    rows = token_rows(batch)
    count = len(rows.ids)
    if count and (int(rows.ids.min()) < 0 or int(rows.ids.max()) >= step.vocab):
        raise IndexError(f"token ids must lie in [0, {step.vocab}), got min {int(rows.ids.min())} and "
                         f"max {int(rows.ids.max())}")
    on_kernels = count <= step.kernel_rows
    cache = batch.cache
    storages = [layer.storage_rows() for layer in cache.layers]
    if any(storage is None for storage in storages):
        raise ValueError("the kernels read a paged cache's blocks in place: its storage must be on the CPU")
    forward_rounding = step.row_layers[2]  # (what the step rounds to: the model's dtype)
    storages = [_kernel_storage(layer, rows, forward_rounding) for rows, layer in zip(storages, cache.layers)]
    recent = recent_window(cache, batch, rows, step.kv_heads, step.head_dim)
    layouts = [
        numba_products.paged_layout(cache.block_size, step.kv_heads, window, recent.length)
        for window in step.config.layer_windows
    ]
    groups = [rows.groups[layer.group] for layer in cache.layers]
    threads = torch.get_num_threads()
    with torch_threads(1 if on_kernels else None):
        numba_products.set_threads(threads)
        x = step.embed_rows(rows.ids)  # (N, hidden)
        cos, signed_sin = step.rope_rows(rows.positions)  # (N, D) each
        layers = _on_kernels if on_kernels else _with_products
        layers(step, x, cos, signed_sin, rows, storages, layouts, groups, recent)
        return torch.from_numpy(_logits(step, x[rows.last]))


@dataclass
class RecentWindow:
    """A cache's full-precision window (`kvcache.cache.paged.recent`) as one step's kernels
    write and read it; `length` 0 and no layers where the cache has none."""

    layers: list[tuple[np.ndarray, np.ndarray]]  # per layer: keys (R', D), values, as the kernels read
    exact: np.ndarray  # (N, 2) int64: each token's row's first exact position and its first storage row
    kept: np.ndarray  # (K,) the tokens the window keeps (its rows' last `length` positions)
    places: np.ndarray  # (K,) their places in the storage (row slot·length + position % length)
    length: int

    def keep(self, layer: int, qkv: np.ndarray, heads: int, kv_heads: int) -> None:
        """Write the kept tokens' keys and values (of qkv (N, ...)) into layer `layer`'s window."""
        if self.layers:
            numba_products.kernels().store(qkv[self.kept], heads, kv_heads, self.places, *self.layers[layer])

    def read(self, layer: int) -> tuple:
        """The kernels' attention's `recent` argument for layer `layer`."""
        return (*self.layers[layer], self.exact) if self.layers else numba_products.NO_RECENT


def recent_window(cache, batch, rows: TokenRows, kv_heads: int, dim: int) -> RecentWindow:
    """`batch`'s full-precision window (its storage allocated for every layer first)."""
    recent = cache.recent
    if recent is None:
        none = np.empty(0, np.int64)
        return RecentWindow([], np.empty((0, 2), np.int64), none, none, 0)
    for index, layer in enumerate(cache.layers):
        recent.prepare(index, kv_heads, dim, dim, layer.forward_dtype)
    seqs = [cache.rows[row] for row in batch.rows]
    firsts = np.array([recent.exact_from(seq, total) for seq, total in zip(seqs, batch.totals)], np.int64)
    bases = np.array([recent.base(seq) for seq in seqs], np.int64)
    exact = np.stack([firsts[rows.table_row], bases[rows.table_row]], axis=1)  # (N, 2)
    kept = np.flatnonzero(rows.positions >= exact[:, 0])
    places = exact[kept, 1] // kv_heads + rows.positions[kept] % recent.window
    layers = [
        tuple(numba_products.as_kernel_array(array_of(t)) for t in recent.kernel_storage(index))
        for index in range(len(cache.layers))
    ]
    return RecentWindow(layers, exact, kept, places, recent.window)


def _kernel_storage(layer, rows, forward_rounding: int) -> tuple:
    """(keys, values, their row formats or None, what queries round to, the forward's dtype) of
    a layer's storage `rows` as the kernels read them. Queries are rounded as the seam's
    attention rounds them: to the forward's dtype (`forward_rounding`) for rows in a kv_dtype of
    their own (the seam reads those back in the forward's dtype), to the rows' own dtype
    otherwise (the forward's)."""
    keys, values = (numba_products.as_kernel_array(a) for a in rows)
    if layer.formats is not None:
        return keys, values, layer.formats, forward_rounding, layer.forward_dtype
    return keys, values, None, numba_products.key_rounding(keys), None


def _on_kernels(step, x, cos, signed_sin, rows: TokenRows, storages, layouts, groups, recent) -> None:
    """Every layer on the kernels: `attention_inputs`, `store`, `layer_output` (x in place)."""
    kernels = numba_products.kernels()
    heads, kv_heads, dim, eps = step.heads, step.kv_heads, step.head_dim, step.eps
    layers, _, rounding = step.row_layers
    for index, (w, storage, layout, (tables, slots)) in enumerate(zip(layers, storages, layouts, groups)):
        keys, values, _, key_rounding, _ = storage
        qkv = np.empty((len(x), (heads + 2 * kv_heads) * dim), np.float32)
        kernels.attention_inputs(
            x, w.norm1, eps, w.qkv, w.qkv_bias, w.q_norm, w.k_norm, cos, signed_sin,
            step.scale, heads, kv_heads, rounding, qkv,
        )
        kernels.store(qkv, heads, kv_heads, slots, keys, values)
        recent.keep(index, qkv, heads, kv_heads)
        kernels.layer_output(
            x, qkv, heads, kv_heads, keys, values, tables, rows.table_row, rows.lengths, layout,
            _NO_MASK, key_rounding, recent.read(index),
            w.o, w.o_bias, w.norm2, eps, w.gate_up, w.gate_up_bias, w.down, w.down_bias, rounding,
        )


def _with_products(step, x, cos, signed_sin, rows: TokenRows, storages, layouts, groups, recent) -> None:
    """Every layer's products on the backend's products for many rows, the kernels between them
    (`normed_rows`, `rope`, `store`, the SwiGLU, attention), x in place. Each token's norms and
    SwiGLU are the layer kernels' functions; its attention too where the step is
    chunk-invariant (`_each_token_attention`), else a prompt chunk's on torch (`_attention`)."""
    kernels = numba_products.kernels()
    heads, kv_heads, eps = step.heads, step.kv_heads, step.eps
    kernel_layers, _, _ = step.row_layers
    layers, _, linear = step.products(len(x))
    attention = _each_token_attention if step.chunk_invariant else _attention
    for index, (w, norms, storage, layout, (tables, slots)) in enumerate(zip(
        layers, kernel_layers, storages, layouts, groups
    )):
        qkv = linear(_normed(x, w.norm1, eps), w.qkv, w.qkv_bias)  # (N, (H + 2·H_kv)·D)
        kernels.rope(qkv, cos, signed_sin, norms.q_norm, norms.k_norm, eps, step.scale, heads, kv_heads)
        kernels.store(qkv, heads, kv_heads, slots, *storage[:2])
        recent.keep(index, qkv, heads, kv_heads)
        attended = attention(step, qkv, rows, storage, tables, layout, recent.read(index))
        x += linear(attended, w.o, w.o_bias)
        gate_up = linear(_normed(x, w.norm2, eps), w.gate_up, w.gate_up_bias)
        x += linear(_swiglu(gate_up), w.down, w.down_bias)


def _normed(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x (N, n) / rms(x) · weight (n,) per row, on the kernels (`normed_rows`: the layer kernels'
    arithmetic); a new array."""
    out = np.empty_like(x)
    numba_products.kernels().normed_rows(x, weight, eps, out)
    return out


#: tokens `_each_token_attention` attends to a call: the kernel's scratch grows with tokens × keys
ATTENDED_AT_ONCE = 32


def _each_token_attention(step, qkv, rows: TokenRows, storage, tables, layout, recent: tuple) -> np.ndarray:
    """(N, H·D) attention of every token of a step on the kernels' attention, each query over its
    own keys in the order a one-token step scores them, ATTENDED_AT_ONCE tokens a call.
    storage: `_kernel_storage`'s; recent: the kernels' argument."""
    attended = np.empty((len(qkv), step.heads * step.head_dim), np.float32)
    for at in range(0, len(qkv), ATTENDED_AT_ONCE):
        these = slice(at, at + ATTENDED_AT_ONCE)
        attended[these] = _on_kernel_attention(step, qkv, rows, these, storage, tables, layout, recent)
    return attended


def _on_kernel_attention(
    step, qkv, rows: TokenRows, these, storage, tables, layout, recent: tuple
) -> np.ndarray:
    """(n, H·D) attention of the tokens `these` (a slice or indices) on the kernels' `attention`,
    in place through the block tables."""
    out = np.empty((len(rows.ids[these]), step.heads * step.head_dim), np.float32)
    numba_products.kernels().attention(
        qkv[these], step.heads, step.kv_heads, storage[0], storage[1], tables, rows.table_row[these],
        rows.lengths[these], layout, _NO_MASK, storage[3],
        recent if not len(recent[2]) else (*recent[:2], recent[2][these]), out,
    )
    return out


def _swiglu(gate_up: np.ndarray) -> np.ndarray:
    """silu(gate)·up (N, inner) of gate_up (N, 2·inner), on the kernels (`swiglu_rows`)."""
    out = np.empty((gate_up.shape[0], gate_up.shape[1] // 2), np.float32)
    numba_products.kernels().swiglu_rows(gate_up, out)
    return out


def _attention(step, qkv, rows: TokenRows, storage, tables, layout, recent: tuple) -> np.ndarray:
    """(N, H·D) attention of every token of a step whose products run elsewhere: the decoding
    rows' single tokens on the kernels' attention (`attend`, in place through the block tables);
    each prompt chunk on torch's fused attention over its own row's keys and values read out of
    their blocks once (a chunk's queries share its keys, which a matrix product reads once for all
    of them where the kernels would read them once per query), its full-precision window's
    positions from there. storage: `_kernel_storage`'s; recent: the kernels' argument."""
    heads, kv_heads, dim = step.heads, step.kv_heads, step.head_dim
    attended = np.empty((len(qkv), heads * dim), np.float32)
    singles = rows.singles
    if len(singles):
        attended[singles] = _on_kernel_attention(step, qkv, rows, singles, storage, tables, layout, recent)
    size = layout[numba_products.kernels().BLOCK]
    window = int(layout[numba_products.kernels().WINDOW])
    for row in np.flatnonzero(rows.counts > 1):
        first, count = rows.firsts[row], rows.counts[row]
        end = int(rows.positions[first + count - 1]) + 1  # the keys its last token sees
        start = max(0, int(rows.positions[first]) - window + 1) if window else 0  # its first's
        positions = np.arange(start, end)
        held = tables[row, positions // size] * size + positions % size  # (T,) slots
        k, v = _chunk_rows(storage, held, kv_heads, dim)
        if len(recent[2]):
            _put_recent(k, v, recent, layout, positions, first)
        attended[first : first + count] = _chunk_attention(
            qkv[first : first + count], k, v, positions, rows.positions[first : first + count],
            window, heads, kv_heads, dim,
        )
    return attended


def _chunk_rows(storage, held, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (T, H_kv, D) at storage slots `held` (T,) (storage: `_kernel_storage`'s),
    read out in the storage's dtype (rows in a kv_dtype's format in the forward's, as the seam
    reads them)."""
    rows = held[:, None] * kv_heads + np.arange(kv_heads)  # (T, H_kv) storage rows
    k, v = (_tensor(stored[rows.reshape(-1)]) for stored in storage[:2])
    if storage[2] is not None:
        k, v = (row_format.unpack(read, storage[4]) for row_format, read in zip(storage[2], (k, v)))
    return k.view(len(held), kv_heads, dim), v.view(len(held), kv_heads, dim)


def _put_recent(k, v, recent: tuple, layout, positions: np.ndarray, token: int) -> None:
    """Overwrite keys and values k, v (T, H_kv, D) at `positions` (T,) of the row of token index
    `token` with its full-precision window's rows where that holds them (recent: the kernels'
    argument), in place."""
    kv_heads = k.shape[1]
    first, base = recent[2][token]
    exact = np.flatnonzero(positions >= first)
    if not len(exact):
        return
    length = layout[numba_products.kernels().RECENT]
    rows = (base + positions[exact] % length * kv_heads)[:, None] + np.arange(kv_heads)  # (E, H_kv)
    for target, stored in zip((k, v), recent[:2]):
        target[torch.from_numpy(exact)] = _tensor(stored[rows.reshape(-1)]).view(len(exact), kv_heads, -1).to(
            target.dtype
        )


def _chunk_attention(qkv, k, v, key_positions, query_positions, window, heads, kv_heads, dim):
    """(n, H·D) attention of one row's n prompt tokens (qkv (n, ...): queries scaled already)
    over its keys and values k, v (T, H_kv, D) at key_positions (T,), causal and within
    `window` (0: none), on torch's fused attention in their dtype."""
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # (H_kv, T, D)
    q = torch.from_numpy(qkv[:, : heads * dim]).view(len(qkv), heads, dim).transpose(0, 1)  # (H, n, D)
    if k.dtype != torch.float32:
        q = q.to(k.dtype)
    keys_at, queries_at = torch.from_numpy(key_positions), torch.from_numpy(query_positions)
    visible = visible_keys(queries_at[:, None], keys_at[None, :], window)  # (n, T)
    out = F.scaled_dot_product_attention(
        q[None], k[None], v[None], attn_mask=visible, scale=1.0, enable_gqa=heads != kv_heads
    )  # (1, H, n, D)
    return out[0].transpose(0, 1).reshape(len(qkv), heads * dim).float().numpy()


def _tensor(stored: np.ndarray) -> torch.Tensor:
    """Stored keys or values as the kernels read them (float32, bfloat16 bits, float16 bits as
    int16) as a torch tensor of their dtype, sharing their memory."""
    return tensor_of(stored.view(np.float16) if stored.dtype == np.int16 else stored)


def _logits(step, x: np.ndarray) -> np.ndarray:
    """(S, vocab) logits of the wanted tokens' hidden states x (S, hidden)."""
    if len(x) == 0:
        return np.empty((0, step.vocab), np.float32)
    if len(x) <= step.kernel_rows or step.chunk_invariant:
        _, (head_parts, head_bias), rounding = step.row_layers
        logits = np.empty((len(x), numba_products.outputs(head_parts)), np.float32)
        numba_products.kernels().normed_product(x, step.final_norm, step.eps, head_parts, head_bias,
                                                rounding, logits)
        return logits
    _, lm_head, linear = step.products(len(x))
    return linear(_normed(x, step.final_norm, step.eps), lm_head, None)
