"""The engine's KV pool: one PagedCache sized from a byte budget as `kvcache.memory` sizes it, a row
for each running request (in `running`'s order), and the one place its blocks change hands.

A step goes snapshot -> schedule -> apply -> run -> commit:
- `snapshot` reads what the pure scheduler needs (each running sequence's blocks, what each
  waiting prompt's prefix would attach, the free blocks);
- `apply(plan)`, before any forward, frees the preempted rows, attaches the admitted prompts'
  cached prefixes, has the tiers below the pool load the next blocks of a prompt (at most the
  chunk the plan gave it, so a tier hit never takes blocks the plan gave to other rows), and
  reserves every row's blocks for the step, all at once; it returns the step's `PagedBatch`;
- the runner's forward only reads the block tables and writes the reserved slots;
- `commit` records what the forward wrote.
The tiers below the pool are one connector (`kvcache.tiers.connector.KVConnector`): the pool asks
it at submit (`prefetch`), before admitting (`admissible`) and in `apply`, and keeps no tier state
of its own, nor does a `Request`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache.cache import CacheConfigError, OutOfBlocksError, PagedBatch, PagedCache
from kvcache.cache.paged.recent import checked_window
from kvcache.cache.paged.rows import attachable_blocks
from kvcache.engine.request import Request
from kvcache.engine.scheduler import Limits, Plan, RunningSeq, WaitingSeq
from kvcache.generation.params import RequestError
from kvcache.geometry import read_geometry
from kvcache.memory import (
    PAGED_KV_DTYPES,
    KVShape,
    kv_window_bytes,
    paged_block_bytes,
    paged_kv_dtype,
    paged_pool,
    parse_size,
    window_pool_blocks,
)


@dataclass
class StepWork:
    """One step applied to the pool: the batch the backend runs and the request of each of its
    rows (batch.rows[i] is requests[i]'s row)."""

    batch: PagedBatch
    requests: list[Request]
    attached: dict[int, int]  # request id -> prompt tokens its prefix attached (admitted ones)
    loaded: dict[int, int]  # request id -> prompt tokens loaded from the KV store this step
    # request id -> the draft tokens its row runs after its newest token (speculative decoding)
    drafts: dict[int, list[int]] = field(default_factory=dict)


class KVPool:
    """The engine's PagedCache (`cache`), the requests holding its rows (`running`), and the
    tiers below it (`connector`; see the module docstring)."""

    def __init__(
        self,
        model,
        limits: Limits,
        kv_budget: int | str | None,
        num_blocks: int | None,
        prefix_caching: bool,
        store=None,
        kv_dtype: str | None = None,
        kv_window: int = 0,
    ) -> None:
        self.shape = KVShape.from_geometry(read_geometry(model.config))  # (what kvcache.memory counts)
        self.model_dtype = str(model.dtype).removeprefix("torch.")
        self.cache, self.block_bytes = build_cache(
            model, self.shape, limits, kv_budget, num_blocks, kv_dtype, kv_window
        )
        self.block_size = limits.block_size
        self.prefix_caching = prefix_caching
        self.connector = _connector(store, model, self.cache)
        self.running: list[Request] = []  # row r of the cache is running[r]'s

    @property
    def store_tier(self):
        """The connector over the KV store (`kvcache.tiers.store_tier.TierConnector`), or None."""
        return None if self.connector.store is None else self.connector

    @property
    def full_allocator(self):
        """The full-attention layers' block bookkeeping (None when every layer slides: their
        blocks are sized never to run short)."""
        return self.cache.full_allocator

    # ---- what the scheduler sees --------------------------------------------------------------
    def snapshot(self, waiting, cap: int) -> tuple[list[RunningSeq], list[WaitingSeq], int]:
        """(running sequences in row order, the first `cap` waiting requests, free blocks): the
        running ones with the full-attention blocks each holds and could free, the waiting ones
        with the tokens their prefix would attach and the idle cached blocks that takes. A
        waiting request's prefix hashes are kept on it while its tokens stay the same."""
        full = self.full_allocator
        running = [
            RunningSeq(
                request.id,
                request.arrival,
                len(request.tokens),
                request.cached,
                0 if full is None else len(full.sequence(seq).table),
                0 if full is None else full.unshared_blocks(seq),
                0 if request.speculation is None else len(request.speculation.draft),
            )
            for request, seq in zip(self.running, self.cache.rows)
        ]
        seen = []
        for request in waiting:
            if len(seen) >= cap:
                break
            prefix, idle = (0, 0)
            if self.prefix_caching:
                if request.digests is None or request.digests[0] != len(request.tokens):
                    digests = self.cache.prefix_digests(request.tokens, request.root)
                    request.digests = (len(request.tokens), digests)
                within_block = not self.connector.matched(request.id)  # (tier blocks start on one)
                prefix, idle = self.cache.prefix_cost(request.tokens, request.digests[1], request.root,
                                                      within_block=within_block)
            seen.append(WaitingSeq(request.id, request.arrival, len(request.tokens), prefix, idle))
        free = full.num_allocatable if full is not None else 1 << 40
        return running, seen, free

    # ---- reads from the KV store, off the step ----------------------------------------------------
    def prefetch(self, requests: list[Request], wake) -> None:
        """Start reading from the KV store the prompt blocks of `requests` (being submitted, or
        preempted) that the pool does not hold (on the store's reader thread; wake() when an
        answer comes). Called from any thread: what the pool holds is read, not changed, and a
        count made stale by a step meanwhile only makes the read longer or its blocks unused."""
        if self.connector.store is None or not self.prefix_caching:
            return
        for request in requests:
            request.digests = (len(request.tokens), self.cache.prefix_digests(request.tokens, request.root))
            held = attachable_blocks(self.cache, request.digests[1])
            self.connector.lookup(request.id, request.digests[1], held, wake)

    def pin(self, tokens: list[int]) -> int:
        """Pin the whole blocks of `tokens` (`BlockAllocator.pin`; the store tier's too); the tokens
        they hold."""
        digests = self.cache.prefix_digests(list(tokens) + [0])  # (every whole block of the tokens)
        for allocator in self.cache.allocators:
            allocator.pin(digests)
        self.connector.pin(digests)
        return len(digests) * self.block_size

    def admissible(self, request: Request, wake) -> bool:
        """Whether `request` may be admitted now: no store read of its blocks is on its way, and
        the one that came still follows what the pool holds (after blocks it started from were
        evicted, a new read starts, and the request waits for it)."""
        held = lambda: attachable_blocks(self.cache, request.digests[1])  # noqa: E731 (asked when needed)
        return self.connector.ready(request.id, held, wake)

    def wait_for_tiers(self, request: Request, timeout_s: float) -> None:
        """Block until the tiers answered `request`'s read, `timeout_s` at most."""
        self.connector.wait(request.id, timeout_s)

    # ---- applying a plan ------------------------------------------------------------------------
    def release(self, requests: list[Request]) -> None:
        """Free these requests' rows (their blocks go back; hashed full blocks stay cached); each
        lets go of what the tiers kept for it (`KVConnector.finished`)."""
        self.connector.finished([request.id for request in requests])
        gone = {request.id for request in requests}
        keep = [row for row, request in enumerate(self.running) if request.id not in gone]
        if len(keep) == len(self.running):
            return
        self.cache.select(keep)
        self.running = [self.running[row] for row in keep]
        for request in requests:
            request.cached = 0

    def apply(self, plan: Plan, admitted: list[Request]) -> StepWork:
        """Attach the `admitted` requests' prefixes (each takes a row), have the tiers load prompt
        blocks within each chunk the plan gave (`KVConnector.admit`, `KVConnector.load`), and
        reserve every row's blocks for the step (the plan's preempted rows must be released first).
        Returns the step's work; rows whose whole chunk came from the tiers run nothing this step."""
        attached, loaded = {}, {}
        for request in admitted:
            request.cached = self.cache.add_sequence(  # (whole blocks only when the tiers load more)
                request.tokens, reuse_prefix=self.prefix_caching, root=request.root,
                within_block=not self.connector.admit(request.id),
            )
            attached[request.id] = request.cached
            self.running.append(request)
        rows = {request.id: row for row, request in enumerate(self.running)}
        work = [(rows[seq_id], 1) for seq_id in plan.decode] + [
            (rows[seq_id], count) for seq_id, count in plan.prefill
        ]
        batch_rows, tokens, sample, drafts = [], [], [], {}
        for row, count in work:
            request = self.running[row]
            end = request.cached + count  # the plan counted from what the row held then
            if count > 1:  # a prompt chunk: the blocks the tiers read, no further than a hit may cover
                reusable = min(end, self.cache.reusable_tokens(len(request.tokens)))
                loaded[request.id] = self.connector.load(request.id, self.cache, row, request.cached,
                                                         reusable)
                request.cached += loaded[request.id]
                if loaded[request.id] and end < len(request.tokens):  # (the next chunk's blocks
                    end = max(request.cached, end // self.block_size * self.block_size)  # aligned)
            if request.cached < end:
                run = request.tokens[request.cached : end]
                wanted = int(end == len(request.tokens))
                granted = plan.drafts.get(request.id, 0)
                if granted:  # its draft's slots follow its newest token's; their logits wanted too
                    drafts[request.id] = request.speculation.draft[:granted]
                    run = run + drafts[request.id]
                    wanted += granted
                batch_rows.append(row)
                tokens.append(run)
                sample.append(wanted)
        try:
            self.cache.reserve(batch_rows, [self.running[row].cached + len(run)
                                            for row, run in zip(batch_rows, tokens)])
        except OutOfBlocksError as error:  # the scheduler counted these blocks: a bug, not a load
            raise RuntimeError(f"the step's plan does not fit the pool it was made for: {error}") from None
        batch = PagedBatch(self.cache, batch_rows, tokens, sample)
        return StepWork(batch, [self.running[row] for row in batch_rows], attached, loaded, drafts)

    def commit(self, work: StepWork) -> None:
        """Record what the step's forward wrote: each row now holds its chunk's tokens (full
        blocks hashed, findable by prefix once their ids are declared)."""
        self.cache.commit(work.batch.rows, work.batch.totals)
        for request, total in zip(work.requests, work.batch.totals):
            request.cached = total

    def settle(self, work: StepWork, known: dict[int, int]) -> None:
        """After the step's tokens were chosen: each draft row trimmed to what plain decoding
        leaves (its newest token and the chosen tokens but the last; the refused draft's blocks
        freed), then every sampling row's new tokens declared (its tokens past `known[request
        id]`), so its full blocks become findable: a draft token's block never was."""
        if work.drafts:
            lengths = self.cache.row_lengths
            for index, request in enumerate(work.requests):
                if request.id in work.drafts and request in self.running:
                    start = work.batch.starts[index]  # (its newest token's position)
                    keep = start + max(len(request.tokens) - known[request.id], 1)
                    lengths[self.running.index(request)] = keep
                    request.cached = keep
            self.cache.truncate_rows(lengths)
        for request in work.requests:
            if request.id in known and len(request.tokens) > known[request.id]:
                self.cache.declare_tokens(self.running.index(request), request.tokens[known[request.id] :])


def _connector(store, model, cache: PagedCache):
    """The tiers below the pool: a `TierConnector` over `store`, or the connector of no tiers.
    (Imported here: the tiers' connector is an observer of the engine, which imports this module.)"""
    if store is None:
        from kvcache.tiers.connector import KVConnector

        return KVConnector()
    from kvcache.tiers.store_tier import TierConnector

    return TierConnector(store, model, cache)


def build_cache(
    model, shape: KVShape, limits: Limits, kv_budget: int | str | None, num_blocks: int | None,
    kv_dtype: str | None = None,
    kv_window: int = 0,
) -> tuple[PagedCache, int]:
    """The PagedCache for `model` (its KV `shape`) and the bytes of one full-attention block.

    kv_budget: bytes (an int, or "256MiB") for keys and values: the sliding layers get enough
    blocks for `limits.max_running` rows of any length, the full layers as many whole blocks as
    the rest holds (`kvcache.memory.paged_pool`). num_blocks: the full layers' size in blocks
    instead. kv_dtype: what the rows are stored as ("bfloat16", "int8", "int8/int4" …: `PagedCache`;
    quantized rows' scales counted), None in the model's dtype. kv_window: with a kv_dtype, each
    row's last kv_window tokens also kept in the model's dtype (`PagedCache`), their bytes for
    `limits.max_running` rows taken from the budget first. Raises RequestError for a budget
    that holds no block, an unknown kv_dtype or a window without one."""
    window_bytes = _checked_window(kv_window, kv_dtype, shape, model, limits.max_running)
    dtype_name = kv_dtype or str(model.dtype).removeprefix("torch.")
    block_bytes = paged_block_bytes(shape, limits.block_size, dtype_name)
    budget = 0
    if num_blocks is None:
        budget = parse_size(kv_budget) if isinstance(kv_budget, str) else kv_budget
        if isinstance(budget, int) and not isinstance(budget, bool):
            budget -= window_bytes
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < block_bytes:
            beside = f" beside the kv_window's {window_bytes} bytes" if window_bytes else ""
            raise RequestError(
                f"kv_budget must hold at least one block of {block_bytes} bytes{beside}, got {kv_budget!r}"
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
    cache = PagedCache(
        num_blocks if num_blocks is not None else max(full, 1),
        limits.block_size,
        window_blocks=window or None,
        config=model.config,
        dtype=model.dtype,
        device=model.device,
        kv_dtype=kv_dtype,
        kv_window=kv_window,
    )
    if cache.recent is not None:  # (its bytes for max_running rows taken now, as budgeted)
        for layer in range(shape.layers):
            sizes = (shape.kv_heads, shape.head_dim, shape.head_dim)
            cache.recent.prepare(layer, *sizes, model.dtype, model.device, rows=limits.max_running)
    return cache, block_bytes


def _checked_window(kv_window: int, kv_dtype: str | None, shape: KVShape, model, rows: int) -> int:
    """The bytes of `rows` rows' full-precision window (`kvcache.memory.kv_window_bytes`), after
    checking kv_dtype and kv_window (RequestError)."""
    if kv_dtype is not None and not paged_kv_dtype(kv_dtype):
        raise RequestError(f"kv_dtype must be None, one of {PAGED_KV_DTYPES} or a keys/values pair of them "
                           f"such as 'int8/int4', got {kv_dtype!r}")
    try:
        checked_window(kv_window, kv_dtype)
    except CacheConfigError as error:
        raise RequestError(str(error)) from None
    model_dtype = str(model.dtype).removeprefix("torch.")
    return kv_window_bytes(shape, kv_window, model_dtype, rows) if kv_window else 0
