"""The serving engine: requests in, token streams out, over one paged KV pool.

    engine = Engine(model, tokenizer, kv_budget="256MiB", max_running=16)
    handle = engine.submit("Once upon a time", max_tokens=32)    # or token ids, or chat messages
    for token in handle: ...                                      # tokens as they are made
    handle.result().finish_reason, handle.result().usage

Each `step()` asks the scheduler (`engine.scheduler`, a pure function) for a plan, then runs ONE
batched decode forward on the backend over every decoding row (each row at its own length in the
pool, the weights read once for all of them) and one prefill forward over the planned prompt
chunks, samples each request's next token with its own settings and generator, and retires the
finished (their blocks freed; full blocks stay cached, found by later prompts that start the same
way). A request whose decode step finds no block is preempted: its row is freed and it is
recomputed later from its tokens, attaching whatever of them is still cached.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

import torch

from kvcache.backends import choose_backend
from kvcache.backends.torch_step import last_logits
from kvcache.cache.paged_rows import prefill_inputs
from kvcache.engine.metrics import EngineMetrics
from kvcache.engine.params import RequestError, SamplingParams
from kvcache.engine.pool import build_pool
from kvcache.engine.prompts import prompt_ids, tokenizer_eos
from kvcache.engine.request import Completion, Request, RequestHandle
from kvcache.engine.scheduler import Limits, blocks_for, schedule
from kvcache.engine.store_tier import StoreTier, open_store
from kvcache.engine.views import running_view, waiting_view
from kvcache.generation.stops import StopRule
from kvcache.progress import ProgressBar


class Engine:
    """Continuous batching of many requests over one PagedCache of `kv_budget` bytes (or
    `num_blocks` blocks) of `block_size` tokens.

    Args:
        model: a kvcache model; tokenizer: for text and chat prompts and stop strings.
        backend: the decode step ("auto", "numpy", "half", "torch" or a DecodeBackend).
        kv_budget: bytes for keys and values (an int, or "256MiB"); the pool holds as many whole
            blocks as `kvcache.memory` says fit. num_blocks: the pool's size in blocks instead.
        max_running: sequences holding a row at once. token_budget: tokens one step runs (decode
            rows and prefill chunks together), so a long prompt is prefilled in chunks while the
            others keep decoding.
        prefix_caching: attach cached blocks of earlier prompts that start the same way (False:
            every prompt is prefilled whole).
        kv_store: a second tier of prefix blocks shared with other replicas: a URL
            ("redis://127.0.0.1:6379/0") or a store object (`RedisBlockStore`); see store_tier.py.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        backend="auto",
        kv_budget: int | str | None = "256MiB",
        num_blocks: int | None = None,
        block_size: int = 16,
        max_running: int = 16,
        token_budget: int = 256,
        prefix_caching: bool = True,
        kv_store=None,
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.prefix_caching = prefix_caching
        if max_running < 1 or token_budget < max_running:
            raise RequestError(
                f"need max_running >= 1 and token_budget >= max_running, got {max_running} and {token_budget}"
            )
        self.limits = Limits(block_size, max_running, token_budget)
        self.pool, self.block_bytes = build_pool(model, self.limits, kv_budget, num_blocks)
        self.backend = choose_backend(model, backend)
        self.store_tier = None if kv_store is None else StoreTier(open_store(kv_store), model, self.pool)
        self.metrics = EngineMetrics()
        # called with every Completion as its request ends (a server's metrics); must not raise
        self.on_finish: Callable[[Completion], None] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the order of self.pool.rows
        self._incoming: list[Request] = []
        self._ids = 0
        self._lock = threading.Lock()  # guards _incoming and _ids (submit may come from any thread)
        self._step_lock = threading.Lock()
        self._wake_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._looping = threading.Event()  # set while a loop (start's thread, or run) makes the steps

    # ---- capacity ---------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Blocks of the full-attention layers' pool (0 when every layer slides)."""
        return 0 if self.pool.full_allocator is None else self.pool.num_blocks

    def capacity(self, tokens: int) -> int:
        """How many sequences of `tokens` tokens the pool holds at once (no prefix shared); the
        sliding layers' blocks are sized for max_running sequences of any length."""
        if self.pool.full_allocator is None:
            return self.limits.max_running
        return self.num_blocks // blocks_for(tokens, self.limits.block_size)

    # ---- submitting -------------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, **fields) -> RequestHandle:
        """Queue one request; return its handle. prompt: token ids, a text (needs the tokenizer),
        or chat messages [{"role", "content"}, …] (through the tokenizer's chat template). params,
        or its fields as keywords (max_tokens=…, temperature=…). Refused with RequestError, and
        nothing queued, when a field is out of range or the request cannot fit even alone."""
        params = params if params is not None else SamplingParams(**fields)
        config = self.model.config
        params.check(config.vocab_size)
        ids = prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        total = len(ids) + params.max_tokens
        if total > config.max_position_embeddings:
            raise RequestError(
                f"the prompt's {len(ids)} tokens and max_tokens={params.max_tokens} make {total}, past the "
                f"model's context of {config.max_position_embeddings}"
            )
        if (
            self.pool.full_allocator is not None
            and blocks_for(total, self.limits.block_size) > self.num_blocks
        ):
            raise RequestError(
                f"the request needs up to {total} tokens; the KV pool holds {self.num_blocks} blocks "
                f"of {self.limits.block_size} ({self.num_blocks * self.limits.block_size} tokens): "
                "raise kv_budget"
            )
        eos = () if params.ignore_eos else (*config.eos_token_id, *tokenizer_eos(self.tokenizer))
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need the engine's tokenizer to read the generated text")
        rule = StopRule((*eos, *params.stop_token_ids), params.stop, self.tokenizer)
        with self._lock:
            request_id = self._ids
            self._ids += 1
            handle = RequestHandle(request_id, self)
            self._incoming.append(Request(request_id, ids, params, rule, handle, arrival=request_id))
        self.metrics.submitted += 1
        self._wake()
        return handle

    def warm_up(self) -> None:
        """Run two short requests side by side before serving, so every road a step takes has run
        once (one row, several rows, a prompt): kernels compiled (on the first run of an install
        numba compiles them, a pause of seconds), weights laid out. The counters start again
        after; the requests' blocks are freed."""
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        handles = [self.submit([token], params) for token in (0, 1)]
        for handle in handles:
            handle.result()
        self.metrics = EngineMetrics()

    def stats(self) -> dict:
        """The counters (`metrics`) and the pool now: running, waiting, blocks used/free/cached."""
        allocator = self.pool.allocator
        m = self.metrics
        return {
            "running": len(self.running),
            "waiting": len(self.waiting) + len(self._incoming),
            "preemptions": m.preemptions,
            "blocks_used": allocator.num_in_use,
            "blocks_free": allocator.num_free,
            "blocks_cached": allocator.num_cached,
            "blocks_total": allocator.num_blocks,
            "prefix_hit_rate": m.prefix_hit_rate,
            "prefill_tokens_per_s": m.prefill_tokens_per_s,
            "decode_tokens_per_s": m.decode_tokens_per_s,
            "submitted": m.submitted,
            "finished": dict(m.finished),
            "generated_tokens": m.generated_tokens,
            "kv_store": None if self.store_tier is None else vars(self.store_tier.store.counters).copy(),
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
        self._wake()

    @property
    def queue_depth(self) -> int:
        """Requests submitted and not yet holding a row."""
        return len(self.waiting) + len(self._incoming)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduling step; False when there was nothing to do."""
        with self._step_lock:
            with self._lock:
                self.waiting.extend(self._incoming)
                self._incoming.clear()
            self._retire(
                [r for r in (*self.running, *self.waiting) if r.cancelled], "cancelled"
            )
            if not self.running and not self.waiting:
                return False
            full = self.pool.full_allocator
            free = full.num_allocatable if full is not None else 1 << 40  # sliding blocks never run short
            running = running_view(self.running, self.pool)
            waiting = waiting_view(self.waiting, self.pool, self.prefix_caching, self.limits.max_running)
            plan = schedule(running, waiting, free, self.limits)
            by_id = {request.id: request for request in (*self.running, *self.waiting)}
            self._preempt([by_id[i] for i in plan.preempt])
            self._admit([by_id[i] for i in plan.admit])
            with torch.inference_mode():
                self._decode([by_id[i] for i in plan.decode])
                self._prefill([(by_id[i], count) for i, count in plan.prefill])
                if self.store_tier is not None:
                    self.store_tier.offer(self.pool)
            self._retire([r for r in self.running if r.finish is not None], None)
            self.metrics.steps += 1
            return True

    def _preempt(self, victims: list[Request]) -> None:
        if not victims:
            return
        self._drop_rows(victims)
        for request in sorted(victims, key=lambda r: r.arrival, reverse=True):
            request.cached = 0
            self.waiting.appendleft(request)  # recomputed first, in arrival order
        self.metrics.preemptions += len(victims)

    def _admit(self, requests: list[Request]) -> None:
        for request in requests:
            self.waiting.remove(request)
            request.cached = self.pool.add_sequence(request.tokens, reuse_prefix=self.prefix_caching)
            if self.store_tier is not None and self.prefix_caching:  # other replicas' blocks
                row = len(self.running)
                request.cached += self.store_tier.load(self.pool, row, request.tokens, request.cached)
            if not request.admitted:
                request.admitted = True
                request.usage.cached_tokens = request.cached
                self.metrics.prompt_tokens += len(request.prompt)
                self.metrics.cached_prompt_tokens += request.cached
            self.running.append(request)

    def _rows(self, requests) -> list[int]:
        index = {request.id: row for row, request in enumerate(self.running)}
        return [index[request.id] for request in requests]

    def _decode(self, requests: list[Request]) -> None:
        if not requests:
            return
        ids = torch.tensor([[r.tokens[-1]] for r in requests], device=self.model.device)  # (B, 1)
        with self.metrics.timing("decode", len(requests)):
            logits = self._forward(requests, lambda view: self.backend.decode(ids, view))
        if logits is not None:
            for request, row_logits in zip(requests, logits):
                request.cached += 1
                self._sample(request, row_logits)

    def _prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """Each chunk is its own forward: prefill is compute-bound, so batching chunks saves no
        weight reads, while padding them to the longest would compute (and gather) the padding."""
        for request, count in chunks:
            piece = request.tokens[request.cached : request.cached + count]

            def run(view, piece=piece):
                ids, mask = prefill_inputs(view, [piece])
                return last_logits(self.model, ids, mask, view, self.backend)

            with self.metrics.timing("prefill", len(piece)):
                logits = self._forward([request], run)
            if logits is not None:
                request.cached += len(piece)  # the plan's count, or the rest after store blocks
                if request.cached == len(request.tokens):
                    self._sample(request, logits[0])

    def _forward(self, requests: list[Request], run: Callable):
        """run(view) over these requests' rows; on an exception they fail (the others go on)."""
        try:
            return run(self.pool.view(self._rows(requests)))
        except Exception as error:  # noqa: BLE001 (a failed forward fails its requests only)
            for request in requests:
                request.finish = ("error", f"{type(error).__name__}: {error}")
            return None

    def _sample(self, request: Request, logits: torch.Tensor) -> None:
        """The request's next token from its logits (vocab,), declared to the pool and streamed."""
        token = request.take(logits, self.metrics.now())
        if token is not None:
            self.pool.declare_tokens(self._rows([request])[0], [token])
            request.deliver(token)
            self.metrics.generated_tokens += 1

    def _retire(self, requests: list[Request], reason: str | None, error: str | None = None) -> None:
        """Finish these requests (reason and error, or each one's own) and free their rows."""
        if not requests:
            return
        self._drop_rows([r for r in requests if r in self.running])
        for request in requests:
            if request in self.waiting:
                self.waiting.remove(request)
            finish, message = (reason, error) if reason is not None else request.finish
            completion: Completion = request.completion(finish, message)
            self.metrics.finished[finish] = self.metrics.finished.get(finish, 0) + 1
            request.finished(completion)
            if self.on_finish is not None:
                self.on_finish(completion)

    def _drop_rows(self, requests: list[Request]) -> None:
        gone = {request.id for request in requests}
        keep = [row for row, request in enumerate(self.running) if request.id not in gone]
        self.pool.select(keep)  # the dropped rows' blocks go back; hashed full blocks stay cached
        self.running = [self.running[row] for row in keep]

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
        for prompt in prompts:  # refuse a bad batch before queueing any of it
            prompt_ids(prompt, self.tokenizer, self.model.config.vocab_size)
        report = _progress_reporter(progress)
        handles = [self.submit(prompt, params) for prompt in prompts]
        done = 0
        while done < len(handles):
            if not self.running_in_background:
                self.step()
            else:
                handles[done].result()
            finished = sum(handle.done for handle in handles)
            if finished != done and report is not None:
                report(finished, len(handles))
            done = finished
        return [handle.result() for handle in handles]

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
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def close(self) -> None:
        """Stop, and close the KV store connection (its queued writes are dropped)."""
        self.stop()
        if self.store_tier is not None:
            self.store_tier.store.close()

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
        finally:
            self._looping.clear()

    def _fail_everything(self, message: str) -> None:
        """End every queued and running request with finish reason "error" and free the pool's
        rows: what an engine fault leaves cannot be trusted."""
        with self._step_lock:
            with self._lock:
                self.waiting.extend(self._incoming)
                self._incoming.clear()
            self._retire([*self.running, *self.waiting], "error", message)

    def _wake(self) -> None:
        self._wake_event.set()


def _progress_reporter(progress) -> Callable[[int, int], None] | None:
    """generate's progress argument as a callable (done, total), or None."""
    if callable(progress):
        return progress
    if not progress:
        return None
    bar = ProgressBar("kvcache engine")
    return lambda done, total: bar(done / total, f"{done}/{total} requests finished")
