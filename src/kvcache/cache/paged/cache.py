"""PagedCache: the cache object of the paged package (rows, the seam `begin` / `update`, views
for batched forwards, whole-cache operations); its layers, forward layouts, rows and storage
helpers live in the sibling modules."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import count

import torch

from kvcache.blocks.allocator import ROOT_HASH, BlockAllocator
from kvcache.blocks.window import WindowedBlockAllocator

from ..base import Cache, ForwardPlan, LayerMasks
from ..checks import check_batch_index, check_crop, check_new_tokens, where
from ..config import read_cache_geometry
from ..errors import CacheConfigError, CacheShapeError
from .formats import checked_kv_dtype
from .forward import check_windows, first_forward_plan, group_mask, new_columns, plan_forward, row_totals
from .layer import PagedLayer
from .recent import RecentRows, checked_window
from .rows import RowState, append_to_row, prefix_cost, read_row, write_row
from .storage import Step

__all__ = ["PagedCache"]


class PagedCache(Cache):
    """A cache of `num_blocks` blocks of `block_size` tokens shared by its rows (sequences).

    Plugs into the model like any cache: an empty PagedCache given to `generate` makes one row
    per batch row. To reuse cached prompt prefixes, add rows yourself with `add_sequence`
    (see `kvcache.reuse.prefix`), then run only the tokens that were not attached.

    Sliding-window layers (a config with a window in force) form their own group with its own
    block tables (`WindowedBlockAllocator`): a row there holds only the blocks its window still
    needs, and gives the rest back as the window moves; full-attention layers hold every token.

    Args:
        num_blocks: blocks in the pool of the full-attention layers (each such layer stores
            num_blocks × block_size rows); window_blocks: the sliding layers' pool (default
            num_blocks; `kvcache.memory.window_blocks_per_sequence` says what one row needs).
        block_size: tokens per block.
        config: model config (object or dict) giving num_hidden_layers, num_key_value_heads,
            head_dim, and the window and layer types.
        num_layers, kv_heads, head_dim: explicit sizes, merged with the config.
        dtype, device: storage is allocated now when heads, dim and dtype are known, else by
            the first update (with k's dtype and device).
        kv_dtype: what keys and values are stored as (`formats`): "float32", "bfloat16",
            "float16", or quantized, each token's kv head one group with a float16 scale:
            "fp8", "int8", "int4" (reads return them in the forward's dtype, dequantized);
            keys and values apart as "keys/values" ("int8/int4", "bfloat16/int4"); None
            stores them as given.
        kv_window: with a kv_dtype, keep each row's last kv_window positions also in the
            forward's dtype and read them from there (`recent`: the full-precision window of
            recent tokens); 0 (default): every position is read as stored.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        window_blocks: int | None = None,
        config: object = None,
        num_layers: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        kv_dtype: str | None = None,
        kv_window: int = 0,
    ) -> None:
        self.kv_dtype = None if kv_dtype is None else checked_kv_dtype(kv_dtype)
        window = checked_window(kv_window, self.kv_dtype)
        geometry = read_cache_geometry(config, num_layers=num_layers, kv_heads=kv_heads, head_dim=head_dim)
        if geometry.num_layers is None:
            raise CacheConfigError("PagedCache needs the layer count: pass num_layers= or config=")
        self.recent = RecentRows(window, geometry.num_layers) if window else None
        self.allocators: list[BlockAllocator] = []  # one per group of layers (full; windowed)
        self._groups: list[int] = []  # each layer's group
        by_kind: dict[str, int] = {}
        for kind in geometry.layer_kinds or ("full",) * geometry.num_layers:
            if kind not in by_kind:
                by_kind[kind] = len(self.allocators)
                self.allocators.append(
                    BlockAllocator(num_blocks, block_size)
                    if kind == "full"
                    else WindowedBlockAllocator(
                        window_blocks or num_blocks, block_size, geometry.require_window()
                    )
                )
            self._groups.append(by_kind[kind])
        self.rows: list[int] = []  # allocator sequence id of each batch row
        self._seq_ids = count()
        self._steps: list[Step] | None = None  # this forward's, one per group
        self._step_counter = 0
        super().__init__([PagedLayer(self, group) for group in self._groups], device=device)
        if geometry.kv_heads and geometry.head_dim and dtype is not None:
            for layer in self.layers:
                shape = (layer.allocator.num_blocks, block_size, geometry.kv_heads, geometry.head_dim)
                layer.allocate(shape, shape, dtype, self._device or torch.device("cpu"))

    # ---- pool ----------------------------------------------------------------------------------
    @property
    def allocator(self) -> BlockAllocator:
        """The full-attention layers' block bookkeeping (a windowed group's when every layer slides)."""
        return self.full_allocator or self.allocators[0]

    @property
    def full_allocator(self) -> BlockAllocator | None:
        """The full-attention layers' allocator, or None when every layer slides."""
        return next((a for a in self.allocators if a.window is None), None)

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def row_lengths(self) -> list[int]:
        """Tokens stored per row (padding excluded)."""
        return [self.allocator.sequence(seq).num_tokens for seq in self.rows]

    def _storage_device(self, fallback: torch.device | None = None) -> torch.device:
        if self.layers[0].allocated:
            return self.layers[0].device
        return fallback or self._device or torch.device("cpu")

    @property
    def device(self) -> torch.device:
        """Where the blocks live (before the first update: the device given, else CPU)."""
        return self._storage_device()

    # ---- rows ----------------------------------------------------------------------------------
    def add_sequence(self, token_ids: Sequence[int] = (), *, reuse_prefix: bool = True,
                     root: bytes = ROOT_HASH, within_block: bool = True) -> int:
        """Add a row, declaring its first `token_ids`; return how many were attached from cache
        (whole cached blocks matching their start, then with within_block the leading tokens of a
        cached block after them; at most len(token_ids) - 1: run the rest through the model).
        root: its first block's parent hash (`blocks.salt_root`: roots share nothing)."""
        seq = next(self._seq_ids)
        digests = self.prefix_digests(token_ids, root)
        attach = self.prefix_cost(token_ids, digests, root, within_block)[0] if reuse_prefix else None
        for allocator in self.allocators:
            attached = allocator.add_sequence(seq, token_ids, reuse_prefix=reuse_prefix, attach=attach,
                                              root=root)
        self.rows.append(seq)
        if self.recent is not None:
            self.recent.add(seq, attached)
        self._set_columns(max(self.get_seq_length(), attached))
        return attached

    def reusable_tokens(self, length: int) -> int:
        """The most leading tokens of a prompt of `length` tokens a cache hit may cover: all but
        the last (a forward needs a new token), and with a full-precision window (`kv_window`)
        none of the last kv_window: attached rows come as stored, so those are computed again and
        kept exact, and a prompt sent again reads what its first copy read."""
        window = 0 if self.recent is None else self.recent.window
        return max(0, length - max(1, window))

    def prefix_cost(
        self, token_ids: Sequence[int], digests: Sequence[bytes] | None = None, root: bytes = ROOT_HASH,
        within_block: bool = True,
    ) -> tuple[int, int]:
        """`rows.prefix_cost`: (tokens `add_sequence` would attach, the full-attention blocks of
        those no row uses now). Changes nothing."""
        return prefix_cost(self, token_ids, digests, root, within_block)

    def prefix_digests(self, token_ids: Sequence[int], root: bytes = ROOT_HASH) -> list[bytes]:
        """The chained hashes of the whole blocks of `token_ids` a prefix hit may cover, from
        `root` (`kvcache.blocks.salt_root`)."""
        return self.allocators[0].prefix_digests(token_ids, root)

    def declare_tokens(self, row: int, token_ids: Sequence[int], start: int | None = None) -> None:
        """Tell the cache the token ids of row `row`'s positions start, start+1, … (default:
        after those already declared), e.g. generated tokens, so its full blocks become
        findable by later prompts that start the same way. Declare only the tokens actually
        run (or to be run) through the model at those positions."""
        seq = self.sequence_id(row)
        for allocator in self.allocators:
            allocator.declare_tokens(seq, token_ids, start)

    def token_ids(self, row: int) -> list[int]:
        """The token ids declared for row `row` (may run ahead of the positions stored)."""
        return list(self.allocator.sequence(self.sequence_id(row)).token_ids)

    def fork(self, row: int) -> int:
        """Add a row that shares row `row`'s blocks (copied on write); return its index."""
        seq = next(self._seq_ids)
        for allocator in self.allocators:
            allocator.fork(self.sequence_id(row), seq)
        if self.recent is not None:
            self.recent.fork(self.sequence_id(row), seq)
        self.rows.append(seq)
        return len(self.rows) - 1

    def sequence_id(self, row: int) -> int:
        """The block tables' sequence id of row `row` (CacheShapeError when there is no such row)."""
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < len(self.rows):
            raise CacheShapeError(f"row must be in [0, {len(self.rows)}), got {row!r}")
        return self.rows[row]

    def _set_columns(self, columns: int) -> None:
        for layer in self.layers:
            layer.columns = columns

    def _equal_length(self, what: str) -> int:
        lengths = set(self.row_lengths)
        columns = self.get_seq_length()
        if lengths and lengths != {columns}:
            raise CacheShapeError(
                f"{what}: rows hold different token counts {self.row_lengths} over "
                f"{columns} columns; pass an attention_mask (1 = token) so each row's "
                f"positions are counted from its own tokens"
            )
        return columns

    # ---- the seam --------------------------------------------------------------------------------
    def positions(self, new_tokens, layer_idx=0, *, device=None) -> torch.Tensor:
        """Positions past .. past + new_tokens - 1 (T_new,); rows must hold equal lengths."""
        check_new_tokens(new_tokens)
        past = self._equal_length("positions")
        return torch.arange(past, past + new_tokens, device=device or self._storage_device())

    def begin(self, new_tokens, attention_mask=None, *, device=None, windows=None) -> ForwardPlan:
        """Reserve the next forward's blocks (raising `OutOfBlocksError` before anything is
        written) and give its positions (B, T_new) and one mask (B or 1, 1, T_new, T_kv) for
        every layer, or none when every row holds the same keys and runs one new token.

        attention_mask: optional (B, columns + T_new), 1 = token, 0 = padding (not stored).
        Without one, each row appends its T_new tokens at its own length.
        windows: the model's window of each layer; a layer this cache keeps whole, or with a
        wider window, raises `CacheConfigError` (its blocks are laid out by window when built:
        build it with the model's config).
        """
        check_new_tokens(new_tokens)
        check_windows(windows, [self.allocators[group].window for group in self._groups])
        if attention_mask is not None and attention_mask.dim() != 2:
            raise CacheShapeError(
                "attention_mask must be 2-D (batch, columns + new_tokens), got shape "
                f"{tuple(attention_mask.shape)}"
            )
        given = attention_mask.device if attention_mask is not None else device
        where_ = self._storage_device(None if given is None else torch.device(given))
        batch = attention_mask.shape[0] if attention_mask is not None else (len(self.rows) or None)
        if batch is None:  # rows are made by the first update, which gives the batch size
            self._steps = None
            windows = [self.allocators[group].window for group in self._groups]
            return first_forward_plan(new_tokens, windows, where_)
        layouts = self._plan(new_tokens, attention_mask, batch, where_)
        masks = None
        if any(layout.mask is not None for layout in layouts):
            masks = LayerMasks([group_mask(layouts[g], new_tokens) for g in self._groups])
        return ForwardPlan(masks, positions=layouts[0].positions)

    def attention_masks(self, new_tokens, attention_mask=None, *, device=None, windows=None) -> list:
        """`begin`'s masks, built even where every key is visible (all True then). Like `begin`,
        it reserves the forward's blocks: the masks depend on where the rows go."""
        plan = self.begin(new_tokens, attention_mask, device=device, windows=windows)
        if plan.masks is not None:
            return plan.masks
        assert self._steps is not None
        every_key = torch.ones(
            (1, 1, new_tokens, self._steps[0].visible), dtype=torch.bool, device=self.device
        )
        return LayerMasks([every_key] * len(self.layers))

    def _plan(self, new_tokens: int, attention_mask: torch.Tensor | None, batch: int, device: torch.device):
        """Reserve this forward's blocks, make its copies on write, and keep its Step."""
        if not self.rows:
            for _ in range(batch):
                self.add_sequence()
        if batch != len(self.rows):
            raise CacheShapeError(f"the forward has batch {batch}; the cache holds {len(self.rows)} rows")
        self._step_counter += 1
        columns = self.get_seq_length()
        new = new_columns(self.allocators[0], self.rows, columns, new_tokens, attention_mask, device)
        for allocator in self.allocators:  # every group's blocks checked first: all reserved, or none
            allocator.check_reserve(self.rows, row_totals(allocator, self.rows, new[1])[1])
        layouts = [
            plan_forward(allocator, self.rows, new_tokens, new, device, self._step_counter)
            for allocator in self.allocators
        ]
        for layer, group in zip(self.layers, self._groups):
            for source, target in layouts[group].copies:  # a shared partial block, copied before the write
                layer.copy_block(source, target)
        self._steps = [layout.step for layout in layouts]
        return layouts

    def update_layer(
        self, layer: PagedLayer, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The seam's update of `layer` (its `update` calls it): check k, v (B, H_kv, T_new, D), plan
        the forward at layer 0 when `begin` did not, write the rows and return every row's visible
        K, V (B, H_kv, T_kv, D)."""
        layer.check(k, v)
        batch, _, new_tokens, _ = k.shape
        steps = self._steps
        if layer.layer_idx == 0:
            first = None if steps is None else steps[layer.group]
            if first is not None and first.pending and (first.new_tokens, first.batch) != (new_tokens, batch):
                raise CacheShapeError(
                    f"begin was asked for {first.new_tokens} tokens of batch {first.batch}; "
                    f"update got {new_tokens} tokens of batch {batch}"
                )
            if first is None or not first.pending:  # used directly: a forward without padding
                self._plan(new_tokens, None, batch, self._storage_device(k.device))
        steps = self._steps
        step = None if steps is None else steps[layer.group]
        if step is not None and step.pending and layer.layer_idx == self._groups.index(layer.group):
            step.pending = False  # the group's first layer: its rows' positions are written now
            for seq, total in zip(self.rows, step.totals):
                self.allocators[layer.group].commit(seq, total)
        elif step is None or step.pending or layer.last_step == step.step_id:
            raise CacheShapeError(
                f"layer {layer.layer_idx} updated before layer 0 in this forward: update the layers "
                f"in order 0, 1, …, once each"
            )
        elif (step.new_tokens, step.batch) != (new_tokens, batch):
            raise CacheShapeError(
                f"k{where(layer.layer_idx)} has {new_tokens} tokens of batch {batch}; layer 0 "
                f"stored {step.new_tokens} tokens of batch {step.batch} in this forward"
            )
        return layer.write_and_gather(k, v, step)

    # ---- a row out and back in (prompt-cache files), and views for batched forwards -------------
    def row_state(self, row: int) -> RowState:
        """Row `row`'s token ids and its keys (T, H_kv, D) and values (T, H_kv, D_v) per layer,
        copies in position order (`rows.read_row`)."""
        return read_row(self, row)

    def load_row_state(self, state: RowState) -> int:
        """Add a row holding `state`, its full blocks findable by prefix; return its index. A
        refused state (shape, dtype, free blocks) leaves the cache as it was (`rows.write_row`)."""
        row = write_row(self, state)
        self._set_columns(max(self.get_seq_length(), self.row_lengths[row]))
        return row

    def append_to_row(self, row: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> int:
        """Write row `row`'s next T positions from keys (T, H_kv, D) and values (T, H_kv, D_v), one
        of each per layer, computed elsewhere (a block store); return the row's length after
        (`rows.append_to_row`: checked first, a refusal changes nothing)."""
        return append_to_row(self, row, keys, values)  # (its commit sets the columns)

    def reserve(self, rows: Sequence[int], totals: Sequence[int]) -> None:
        """Give rows `rows` (indices) room for `totals` tokens each in every group of layers, for a
        forward that writes their slots in place (a `PagedBatch`'s step): all or nothing
        (`OutOfBlocksError`, nothing changed, when the pool is short), a shared partial last
        block copied on write. `commit` records what the forward wrote."""
        seqs = [self.rows[row] for row in rows]
        for allocator in self.allocators:
            allocator.check_reserve(seqs, list(totals))
        for group, allocator in enumerate(self.allocators):
            copies = allocator.reserve(seqs, list(totals))
            for layer in self.layers:
                if layer.group == group:
                    for source, target in copies:
                        layer.copy_block(source, target)

    def commit(self, rows: Sequence[int], totals: Sequence[int]) -> None:
        """Record that rows `rows` now hold `totals` tokens each (a reserved forward wrote them)."""
        for row, total in zip(rows, totals):
            for allocator in self.allocators:
                allocator.commit(self.rows[row], total)
        self._set_columns(max([self.get_seq_length(), *totals]))

    def view(self, rows: Sequence[int]) -> PagedCache:
        """A cache of rows `rows` (indices, in that order) over the same blocks and allocators,
        for a model forward over just them (the torch backend's step over some rows of a batch):
        each row runs at its own length, its blocks reserved as any forward's are (none more
        where they were reserved before, as the engine's pool does for a whole step) and its
        positions committed. Rows are added, dropped and declared on this cache."""
        if self.layers and not self.layers[0].allocated:
            raise CacheShapeError("a view needs the blocks allocated: build the PagedCache with its dtype")
        view = PagedCache.__new__(PagedCache)
        view.allocators, view._groups, view._seq_ids = self.allocators, self._groups, self._seq_ids
        view.rows = [self.sequence_id(row) for row in rows]
        view._steps, view._step_counter = None, 0
        view.kv_dtype, view.recent = self.kv_dtype, self.recent
        Cache.__init__(view, [PagedLayer(view, group) for group in self._groups], device=self._device)
        for mine, theirs in zip(view.layers, self.layers):
            mine.share_storage(theirs)
        view._set_columns(max(view.row_lengths, default=0))
        return view

    # ---- whole-cache operations ----------------------------------------------------------------
    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` columns: a row padded on the left by p columns keeps
        max_length - p tokens; blocks past the end lose a reference."""
        check_crop(max_length)
        columns = self.get_seq_length()
        if max_length >= columns:
            return
        keeps = [max(0, min(length, max_length - (columns - length))) for length in self.row_lengths]
        for allocator in self.allocators:  # all or nothing: a window may no longer hold what is kept
            for seq, keep in zip(self.rows, keeps):
                allocator.validate_truncate(seq, keep)
        if self.recent is not None:
            for seq, held, keep in zip(self.rows, self.row_lengths, keeps):
                self.recent.truncate(seq, held, keep)
        for allocator in self.allocators:
            for seq, keep in zip(self.rows, keeps):
                allocator.truncate(seq, keep)
        self._set_columns(max_length)
        self._steps = None

    def truncate_rows(self, lengths: Sequence[int]) -> None:
        """Keep each row r's first lengths[r] positions (a step undone: `generate`'s rollback
        after a failed step); all or nothing (`CacheCropError` when a sliding window already gave
        back a block a kept position needs). A row holding fewer keeps what it holds."""
        if len(lengths) != len(self.rows):
            raise CacheShapeError(
                f"truncate_rows takes one length per row ({len(self.rows)}), got {len(lengths)}")
        held = self.row_lengths
        for allocator in self.allocators:
            for seq, keep in zip(self.rows, lengths):
                allocator.validate_truncate(seq, keep)
        if self.recent is not None:
            for seq, had, keep in zip(self.rows, held, lengths):
                self.recent.truncate(seq, had, min(had, keep))
        for allocator in self.allocators:
            for seq, keep in zip(self.rows, lengths):
                allocator.truncate(seq, keep)
        self._set_columns(max(self.row_lengths, default=0))
        self._steps = None

    def select(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` in that order; a repeated row is forked (blocks shared)."""
        index = check_batch_index(indices, len(self.rows), torch.device("cpu")).tolist()
        kept: list[int] = []
        used: set[int] = set()
        for row in index:
            seq = self.rows[row]
            if seq in used:
                child = next(self._seq_ids)
                for allocator in self.allocators:
                    allocator.fork(seq, child)
                if self.recent is not None:
                    self.recent.fork(seq, child)
                kept.append(child)
            else:
                used.add(seq)
                kept.append(seq)
        for seq in self.rows:
            if seq not in used:
                for allocator in self.allocators:
                    allocator.free_sequence(seq)
                if self.recent is not None:
                    self.recent.free(seq)
        self.rows = kept
        self._steps = None

    def repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times (forks that share blocks)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise CacheShapeError(f"repeats must be an int >= 1, got {repeats!r}")
        self.select([row for row in range(len(self.rows)) for _ in range(repeats)])

    def free_rows(self) -> None:
        """Release every row; hashed full blocks stay cached for later prompts (see reset)."""
        for seq in self.rows:
            for allocator in self.allocators:
                allocator.free_sequence(seq)
            if self.recent is not None:
                self.recent.free(seq)
        self.rows = []
        self._set_columns(0)
        self._steps = None

    def reset(self) -> None:
        """Forget every row; full blocks with known token ids stay findable by prefix."""
        self.free_rows()

    @property
    def nbytes_used(self) -> int:
        """Bytes of the blocks in use over all layers (whole blocks)."""
        return sum(layer.nbytes_used for layer in self.layers)

    def __repr__(self) -> str:
        pool = self.allocator
        return (
            f"PagedCache({len(self.layers)} layers, {pool.num_blocks} blocks of {pool.block_size}, "
            f"{'' if self.kv_dtype is None else self.kv_dtype + ' KV, '}"
            f"rows={self.row_lengths}, in use {pool.num_in_use}, cached {pool.num_cached}, "
            f"free {pool.num_free})"
        )
