"""The serving engine: requests in, token streams out, over one paged KV pool.

    engine = Engine(model, tokenizer, kv_budget="256MiB", max_running=16)
    handle = engine.submit("Once upon a time", max_tokens=32)    # or token ids, or chat messages
    for token in handle: ...                                      # tokens as they are made
    handle.result().finish_reason, handle.result().usage

Each `step()` is schedule -> apply -> run: the pure scheduler (`scheduler.schedule`) plans the
step from a snapshot of the pool (who decodes, which prompt chunks run, who joins, who is
preempted); the pool (`pool.KVPool`) applies the plan in one place before any forward (rows
freed and added, cached prefixes attached, store blocks loaded, every row's blocks reserved);
the runner (`runner.Runner`) runs the whole step on the backend in one call and chooses every
sampling row's next token in one batched call. Then the pool commits what the forward wrote and
the finished requests retire (their blocks freed; full blocks stay cached, found by later prompts
that start the same way). When the decoding rows' next blocks do not fit, the newest running
requests are preempted: their rows are freed and they are recomputed later from their tokens,
attaching whatever of them is still cached.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvcache.backends import choose_backend
from kvcache.engine.config import PoolConfig, SchedulerConfig, configs_from
from kvcache.engine.drift_probe import DriftProbe
from kvcache.engine.kv_events import KVEventPublisher
from kvcache.engine.metrics import EngineMetrics
from kvcache.engine.observers import StepObserver
from kvcache.engine.offline import run_to_completion, warm_up
from kvcache.engine.pool import KVPool, StepWork
from kvcache.engine.prompts import prompt_ids
from kvcache.engine.request import Completion, Request, RequestHandle, notify_all
from kvcache.engine.runner import Runner
from kvcache.engine.scheduler import Limits, blocks_for, schedule
from kvcache.engine.sessions import KVHints, Sessions
from kvcache.engine.speculation import (
    RowDrafts,
    choose_in_rounds,
    count_drafts,
    engine_mode,
    propose_drafts,
    request_mode,
)
from kvcache.engine.step_costs import StepCosts
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.generation.stops import StopRule
from kvcache.generation.structured import GrammarState, TokenTable
from kvcache.memory import PACKED_KV_DTYPES, paged_block_bytes
from kvcache.text.eos import default_eos
from kvcache.tiers.open import open_store


def check_request(ids: list[int], params: SamplingParams, config, pool_tokens: int | None,
                  block_size: int) -> None:
    """Raise RequestError unless a request of prompt `ids` fits: its params in range for the
    model's vocabulary, the prompt and max_tokens within its context, and their blocks within a
    pool of `pool_tokens` tokens (None: a pool of sliding layers only, which any length fits)."""
    params.check(config.vocab_size)
    total = len(ids) + params.max_tokens
    if total > config.max_position_embeddings:
        raise RequestError(
            f"the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} make {total}, past the "
            f"model's context of {config.max_position_embeddings}"
        )
    if pool_tokens is not None and blocks_for(total, block_size) * block_size > pool_tokens:
        raise RequestError(
            f"the request needs up to {total} tokens; the KV pool holds {pool_tokens // block_size} blocks "
            f"of {block_size} ({pool_tokens} tokens): raise kv_budget"
        )


class Engine:
    """Continuous batching of many requests over one PagedCache (`PoolConfig`: its bytes or
    blocks, block size, dtype), its steps bounded by a `SchedulerConfig`.

    Args:
        model: a kvcache model; tokenizer: for text and chat prompts and stop strings.
        backend: what runs the steps ("auto", "blocks", "float32", "half", "torch" or a Backend).
        pool: the KV pool's `PoolConfig`; scheduler: the steps' `SchedulerConfig` (`config.py`
            says each field). Their fields may be given as keywords instead (kv_budget="1GiB",
            max_running=32: `config.configs_from`), not both for one config.
        kv_events: publish the pool's block events for KV-aware routers: an endpoint to bind
            ("tcp://127.0.0.1:5557") or a `KVEventPublisher`; see kv_events.py.
        kv_drift_sample: with the pool's kv_dtype, the share of requests (0 to 1) that also run on
            a full-precision shadow pool of a quarter of the pool's bytes, measuring at each of
            their positions how far the stored blocks moved the next-token distribution
            (`drift_probe`; each Completion's `kv_drift`, `stats()["kv_drift"]`); 0: no probe.
        speculate: the requests' default for speculative decoding (`speculation`): None (off:
            only a request whose params say speculate="ngram" drafts) or "ngram" (every request
            drafts by prompt lookup unless its params say speculate="off"). Refused
            (RequestError) on a backend whose steps are not chunk-invariant, with sliding-window
            layers, a kv_dtype or a kv_window, where drafts could change a token.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        backend="auto",
        pool: PoolConfig | None = None,
        scheduler: SchedulerConfig | None = None,
        kv_events=None,
        kv_drift_sample: float = 0.0,
        speculate: str | None = None,
        **settings,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        pool, scheduler = configs_from(pool, scheduler, settings)
        self.pool_config, self.scheduler_config = pool, scheduler
        self.limits = Limits(pool.block_size, scheduler.max_running, scheduler.token_budget)
        store = None if pool.kv_store is None else open_store(pool.kv_store)
        self.pool = KVPool(
            model, self.limits, pool.kv_budget, pool.num_blocks, pool.prefix_caching, store, pool.kv_dtype,
            pool.kv_window,
        )
        self.kv_events = KVEventPublisher(kv_events) if isinstance(kv_events, str) else kv_events
        if self.kv_events is not None:
            self.kv_events.attach(self.pool.cache.allocator, self.pool.connector)  # (full layers, or window)
        self.backend = choose_backend(model, backend)
        self.runner = Runner(model, self.backend)
        self.speculate = engine_mode(speculate, self.backend, model, pool)
        self.drift_probe = self._drift_probe(kv_drift_sample, pool.kv_dtype)
        # bounds what a prompt adds to a step while rows decode (a factor of None: only the budget)
        self.step_costs = StepCosts(scheduler.prefill_slowdown, maximum=scheduler.token_budget)
        self.metrics = EngineMetrics()
        self.sessions = Sessions(self.pool)  # agent sessions' hints (`sessions`; its clock replaceable)
        # what watches the steps (`observers`): the counters, the step costs, and the features that
        # are on, each called at every step
        features = (self.store_tier, self.drift_probe, self.kv_events)
        self.observers: list[StepObserver] = [
            self.metrics, self.step_costs, *(feature for feature in features if feature is not None),
            self.sessions,
        ]
        self.clock = time.perf_counter  # what the step's forwards and tokens are timed by
        # called with every Completion as its request ends (a server's metrics); `notify_all` says
        self.on_finish: Callable[[Completion], None] | None = None
        self.waiting: deque[Request] = deque()
        self._incoming: list[Request] = []
        self._ids = 0
        self._token_table: TokenTable | None = None  # the vocabulary as structured outputs read it
        self._lock = threading.Lock()  # guards _incoming and _ids (submit may come from any thread)
        self._step_lock = threading.Lock()
        self._wake_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._looping = threading.Event()  # set while a loop (start's thread, or run) makes the steps

    def _drift_probe(self, sample: float, kv_dtype: str | None) -> DriftProbe | None:
        """The probe `kv_drift_sample` asks for (None for 0): its shadow pool, full precision, of a
        quarter of the quantized pool's bytes (at least one request of a step's token budget)."""
        if not sample:
            return None
        if kv_dtype is None:
            raise RequestError("kv_drift_sample compares a pool in a kv_dtype (quantized, say) with full "
                               "precision: give kv_dtype too")
        size = self.limits.block_size
        exact_block = paged_block_bytes(self.pool.shape, size, self.pool.model_dtype)
        least = blocks_for(2 * self.limits.token_budget, size)
        blocks = max(self.pool.cache.nbytes // 4 // max(exact_block, 1), least)
        return DriftProbe(self.model, self.backend, sample, blocks, self.limits.block_size)

    @property
    def running(self) -> list[Request]:
        """The requests holding a row of the pool, in row order."""
        return self.pool.running

    @property
    def store_tier(self):
        """The connector over the KV store (`kvcache.tiers.store_tier.TierConnector`), or None."""
        return self.pool.store_tier

    # ---- capacity ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention layers' pool (0 when every layer slides)."""
        return 0 if self.pool.full_allocator is None else self.pool.cache.num_blocks

    @property
    def pool_tokens(self) -> int | None:
        """Tokens the full-attention layers' pool holds (None when every layer slides: any length
        fits)."""
        return None if self.pool.full_allocator is None else self.num_blocks * self.limits.block_size

    def capacity(self, tokens: int) -> int:
        """How many sequences of `tokens` tokens the pool holds at once (no prefix shared); the
        sliding layers' blocks are sized for max_running sequences of any length."""
        if self.pool.full_allocator is None:
            return self.limits.max_running
        return self.num_blocks // blocks_for(tokens, self.limits.block_size)

    def capacity_by_kv_dtype(self, tokens: int) -> dict[str, int]:
        """How many sequences of `tokens` tokens the full layers' bytes would hold at once with keys
        and values in the model's dtype, bfloat16, fp8, int8 and int4 (scales counted:
        `paged_block_bytes`), the pool's own kv_dtype among them; {} when every layer slides (any
        length fits)."""
        if self.pool.full_allocator is None:
            return {}
        budget = self.num_blocks * self.pool.block_bytes
        per_sequence = blocks_for(tokens, self.limits.block_size)
        own = () if self.pool.cache.kv_dtype is None else (self.pool.cache.kv_dtype,)
        dtypes = tuple(dict.fromkeys((self.pool.model_dtype, "bfloat16", *PACKED_KV_DTYPES, *own)))
        block = {dtype: paged_block_bytes(self.pool.shape, self.limits.block_size, dtype) for dtype in dtypes}
        return {dtype: budget // block[dtype] // per_sequence for dtype in dtypes}

    # ---- submitting -------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, *, hints: KVHints | None = None,
               **fields) -> RequestHandle:
        """Queue one request; return its handle. prompt: token ids, a text (needs the tokenizer),
        or chat messages [{"role", "content"}, …] (through the tokenizer's chat template). params,
        or its fields as keywords (max_tokens=…, temperature=…). hints: its session's advisory KV
        hints (`sessions.KVHints`). Refused with RequestError, and nothing queued, when a field is
        out of range or the request cannot fit even alone."""
        params = params if params is not None else SamplingParams(**fields)
        ids = prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        check_request(ids, params, self.model.config, self.pool_tokens, self.limits.block_size)
        config = self.model.config
        eos = () if params.ignore_eos else default_eos(config.eos_token_id, self.tokenizer)
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the engine's tokenizer to read the generated text")
        rule = StopRule((*eos, *params.stop_token_ids), params.stop, self.tokenizer, text=True)
        grammar = None if params.structured is None else self._grammar(params.structured)
        mode = request_mode(params.speculate, self.speculate, self.backend, self.model, self.pool_config)
        drafts = RowDrafts() if mode is not None and grammar is None else None  # (a grammar: none)
        with self._lock:
            request_id = self._ids
            self._ids += 1
            handle = RequestHandle(request_id, self)
            request = Request(request_id, ids, params, rule, handle, arrival=request_id, grammar=grammar,
                              speculation=drafts)
            if hints is not None:
                self.sessions.submitted(request_id, hints, request.root)
            self.pool.prefetch([request], self.wake)  # its blocks in the KV store, read off the step
            self._incoming.append(request)
        self.metrics.submitted += 1
        self.wake()
        return handle

    def _grammar(self, structured) -> GrammarState:
        """A new request's place in its structured output's grammar (the engine's token table is
        built at the first one)."""
        if self.tokenizer is None:
            raise RequestError(f"{structured.field} needs the engine's tokenizer (its token table)")
        if self._token_table is None:
            config = self.model.config
            eos = default_eos(config.eos_token_id, self.tokenizer)
            self._token_table = TokenTable(self.tokenizer, config.vocab_size, tuple(dict.fromkeys(eos)))
        return GrammarState(structured, self._token_table)

    def pin(self, prompt) -> int:
        """Keep `prompt`'s cached blocks (token ids, a text or chat messages) when unused, evicted
        last in the pool and in the disk tier; the tokens of its whole blocks."""
        return self.pool.pin(prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size))

    def warm_up(self) -> None:
        """Run a few short requests before serving, so every road a step takes has run once: a
        prompt chunk beside single tokens, several decoding rows, one row alone. Kernels are
        compiled then (on the first run of an install numba compiles them: a pause of seconds)
        and weights laid out, not inside a request's timings. The counters and the measured step
        costs start again after; the requests' blocks are freed, and the KV store is neither read
        nor written (their blocks are no one's to share)."""
        warm_up(self)

    @contextlib.contextmanager
    def warming(self):
        """The context to run warm-up requests in: each observer's `warming` (the store tier
        neither read nor written, the drift probe sampling every request); the counters and the
        step costs start again after (`reset_counters`)."""
        with contextlib.ExitStack() as observers:
            for observer in self.observers:
                observers.enter_context(observer.warming())
            yield
        self.reset_counters()

    def reset_counters(self) -> None:
        """Start the counters (`metrics`) and the measured step costs again (after a warm-up):
        every observer's `restarted`."""
        for observer in self.observers:
            observer.restarted()

    def stats(self) -> dict:
        """The counters (`metrics`) and the pool now: running, waiting, blocks used/free/cached."""
        allocator = self.pool.cache.allocator
        m = self.metrics
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self._incoming),
            "preemptions": m.preemptions,
            "blocks_used": allocator.num_in_use,
            "blocks_free": allocator.num_free,
            "blocks_cached": allocator.num_cached,
            "blocks_total": allocator.num_blocks,
            "kv_cache_utilization": allocator.num_in_use / allocator.num_blocks,
            "prefix_hit_rate": m.prefix_hit_rate,
            "prefill_tokens_per_s": m.prefill_tokens_per_s,
            "decode_tokens_per_s": m.decode_tokens_per_s,
            "submitted": m.submitted,
            "finished": dict(m.finished),
            "generated_tokens": m.generated_tokens,
            "drafted_tokens": m.drafted_tokens,
            "accepted_tokens": m.accepted_tokens,
            "kv_store": None if self.store_tier is None else self.store_tier.store.stats(),
            "kv_drift": None if self.drift_probe is None else self.drift_probe.stats(),
        }

    def cancel(self, handle: RequestHandle) -> None:
        """End `handle`'s request at the next step (finish reason "cancelled")."""
        handle.cancel()

    def cancel_all(self) -> None:
        """Cancel every request not yet finished (at the next step, or now if no step runs)."""
        with self._lock:
            unfinished = [*self._incoming, *self.waiting, *self.running]
        for request in unfinished:
            request.cancel()
        self.wake()

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet holding a row."""
        return len(self.waiting) + len(self._incoming)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one step (schedule -> apply -> run -> retire); False when there was nothing to do.
        The blocks it made findable or evicted are then published (`kv_events`), as one batch."""
        with self._step_lock:
            try:
                return self._step()
            finally:
                for observer in self.observers:
                    observer.step_ended()

    def _step(self) -> bool:
        """`step`'s work, under the step lock."""
        self._take_incoming()
        self._retire([r for r in (*self.running, *self.waiting) if r.cancelled], "cancelled")
        if not self.running and not self.waiting:
            return False
        admissible = [request for request in self.waiting if self.pool.admissible(request, self.wake)]
        if not self.running and not admissible:  # only store reads on their way: wait for one
            self.pool.wait_for_tiers(self.waiting[0], 0.05)
            return True
        propose_drafts(self.running)  # (what each speculating row would draft; the plan grants it)
        running, waiting, free = self.pool.snapshot(admissible, self.limits.max_running)
        decoding = sum(1 for seq in running if seq.tokens - seq.cached == 1)
        batch = min(self.limits.max_running, len(running) + len(waiting))
        cap = self.step_costs.prefill_cap(decoding, batch)  # held to the cost of the batch being formed
        plan = schedule(running, waiting, free, self.limits, cap)
        by_id = {request.id: request for request in (*self.running, *self.waiting)}
        self._preempt([by_id[i] for i in plan.preempt])
        admitted = [by_id[i] for i in plan.admit]
        for request in admitted:
            self.waiting.remove(request)
        work = self.pool.apply(plan, admitted)
        for observer in self.observers:
            observer.admitted(admitted)
        for observer in self.observers:
            observer.applied(work, self.running)
        if work.requests:
            self._run(work)
        for observer in self.observers:
            observer.stepped(self.pool.cache)
        self._retire([r for r in self.running if r.finish is not None], None)
        return True

    def _preempt(self, victims: list[Request]) -> None:
        self.pool.release(victims)
        for observer in self.observers:
            observer.released(victims)
        self.pool.prefetch(victims, self.wake)  # the store may hold what their rows held
        for request in victims:
            request.first_pass = False
        for request in sorted(victims, key=lambda r: r.arrival, reverse=True):
            self.waiting.appendleft(request)  # recomputed first, in arrival order
        for observer in self.observers:
            observer.preempted(victims)

    def _run(self, work: StepWork) -> None:
        """The step's forward on the runner, what it wrote committed, the sampling rows' tokens
        chosen, declared to the pool and streamed; a failed forward fails the step's requests
        (the others go on), a row whose sampling fails fails alone."""
        batch = work.batch
        decoding = sum(1 for request, tokens in zip(work.requests, batch.tokens)
                       if len(tokens) == 1 + len(work.drafts.get(request.id, ())))
        prompt_tokens = sum(map(len, batch.tokens)) - decoding - sum(map(len, work.drafts.values()))
        sampling = [work.requests[index] for index in batch.sampled]
        masks = self.runner.masks_ahead(sampling)  # grammars' masks, computed while the forward runs
        started = self.clock()
        try:
            logits = self.runner.run(work)
        except Exception as error:  # noqa: BLE001 (the forward's requests fail, the engine goes on)
            for request in work.requests:
                request.finish = ("error", f"{type(error).__name__}: {error}")
            return
        seconds = self.clock() - started
        for observer in self.observers:
            observer.ran(decoding, prompt_tokens, seconds)
        self.pool.commit(work)
        for observer in self.observers:
            observer.forwarded(work, logits)
        known = {request.id: len(request.tokens) for request in sampling}
        now = self.clock()

        def take(request: Request, token: int, logprobs) -> None:
            request.deliver(token, request.append(token, now, logprobs))

        failed = choose_in_rounds(self.runner.choose, logits, work, masks, take)
        for request, message in failed:
            request.finish = ("error", message)
        self.pool.settle(work, known)  # (a refused draft trimmed before any token is declared)
        count_drafts(work, known, seconds)
        for observer in self.observers:
            observer.delivered(sum(len(request.tokens) - known[request.id] for request in sampling))

    def _retire(self, requests: list[Request], reason: str | None, error: str | None = None) -> None:
        """Finish these requests (reason and error, or each one's own) and free their rows."""
        if not requests:
            return
        self.pool.release(requests)
        for observer in self.observers:
            observer.released(requests)
        completions = []
        for request in requests:
            if request in self.waiting:
                self.waiting.remove(request)
            finish, message = (reason, error) if reason is not None else request.finish
            completions.append(request.completion(finish, message))
            request.finished(completions[-1])
        for observer in self.observers:
            observer.completed(completions)
        notify_all(self.on_finish, completions)

    # ---- running many ------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence,
        params: SamplingParams | None = None,
        *,
        progress: bool | Callable[[int, int], None] = False,
        **fields,
    ) -> list[Completion]:
        """Run every prompt to completion (offline) and return their Completions in order.
        progress: True for a bar on stderr, or a callable progress(done, total) called after each
        step that finished some. Every prompt is checked before any is queued."""
        params = params if params is not None else SamplingParams(**fields)
        return run_to_completion(self, prompts, params, progress)

    @property
    def running_in_background(self) -> bool:
        """Whether a loop makes the steps (`start`'s thread, or `run` on another thread): handles
        then wait for it instead of stepping themselves."""
        return self._looping.is_set()

    def start(self) -> None:
        """Run steps on a background thread until `stop()` (handles then wait for it)."""
        if self.running_in_background:
            return
        self._stopping.clear()
        self._looping.set()
        self._thread = threading.Thread(target=self._loop, name="kvcache-engine", daemon=True)
        self._thread.start()

    def run(self, until: Callable[[], bool] | None = None, started: Callable[[], None] | None = None) -> None:
        """Run steps on the calling thread until `stop()` is called (from another thread) or
        `until()` turns true; started: called once the loop counts as running, before its first
        step (e.g. to start the threads that submit). `kvcache serve` runs its engine here, on
        the thread that loaded the model (`kvcache.server.run.serve` says why)."""
        if self.running_in_background:
            raise RuntimeError("the engine's steps already run on a loop: stop() it first")
        self._stopping.clear()
        self._looping.set()
        if started is not None:
            started()
        self._loop(until)

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after its current step (and wait for `start`'s thread to end)."""
        self._stopping.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop, and close what the observers hold: the KV store connection (its queued writes
        are dropped), the events' socket (after AllBlocksCleared)."""
        self.stop()
        self.runner.close()
        for observer in self.observers:
            observer.close()

    def _loop(self, until: Callable[[], bool] | None = None) -> None:
        try:
            while not self._stopping.is_set() and (until is None or not until()):
                try:
                    busy = self.step()
                except Exception as error:  # noqa: BLE001 (a fault outside any one request's work)
                    self._fail_everything(f"{type(error).__name__}: {error}")
                    busy = True
                if not busy:
                    self._wake_event.wait(0.05)
                    self._wake_event.clear()
        except BaseException as error:  # SystemExit, KeyboardInterrupt: said, and no one left waiting
            print(f"kvcache engine: the loop stops on {type(error).__name__}", file=sys.stderr)
            with contextlib.suppress(BaseException):
                self._fail_everything(f"the engine's loop stopped on {type(error).__name__}")
            if threading.current_thread() is not self._thread:
                raise  # run()'s caller (Ctrl-C in a terminal) sees it; start()'s thread just ends
        finally:
            self._looping.clear()

    def _fail_everything(self, message: str) -> None:
        """End every queued and running request with finish reason "error" and free the pool's
        rows: what an engine fault leaves cannot be trusted."""
        with self._step_lock:
            self._take_incoming()
            self._retire([*self.running, *self.waiting], "error", message)

    def _take_incoming(self) -> list[Request]:
        """Move the requests submitted since the last step to `waiting`; returns them."""
        with self._lock:
            incoming, self._incoming = self._incoming, []
        self.waiting.extend(incoming)
        return incoming

    def wake(self) -> None:
        """Wake the loop now (a request was submitted or cancelled): it sleeps while idle."""
        self._wake_event.set()

