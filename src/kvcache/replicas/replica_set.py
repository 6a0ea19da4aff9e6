"""The server's engine when replicas run on Ray Serve: `ReplicaSet` offers what the app calls on an
`Engine` (submit, queue depth, stats, start/run/stop), sends each request to the replicas'
deployment (its router picks the replica) and streams the reply back through a `ReplicaHandle`,
so every route, limit, key and metric of the single server stays as it is. Imports Ray."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import ray
from ray import serve

from kvcache.engine.config import PoolConfig
from kvcache.engine.engine import check_request
from kvcache.engine.request import Completion, ReplyReader, Usage
from kvcache.generation.params import RequestError, SamplingParams
from kvcache.replicas.deployment import ReplicaSettings, replica_deployment
from kvcache.replicas.prefix_index import IMBALANCE

APP = "kvcache"
#: the stats a replica reports that the server's gauges sum over replicas
SUMMED = ("preemptions", "blocks_used", "blocks_free", "blocks_cached", "blocks_total")


class ReplicaHandle(ReplyReader):
    """One request's reply from a replica, read as a `RequestHandle` is: `updates()`, async
    iteration of its token ids, `texts()`, then `result()`; `cancel()` ends the call (the
    replica cancels the request). A replica that fails or dies ends it with finish reason
    "error" (never a hang: Ray fails the call when the actor dies)."""

    def __init__(self, replicas: ReplicaSet, ids: list[int], response) -> None:
        self._replicas, self._ids, self._response = replicas, ids, response
        self._completion: Completion | None = None
        self._waiting = True  # no token yet: counted in the server's queue depth
        self.logprobs: list = []  # each token's TokenLogprobs, when asked, before its update

    @property
    def done(self) -> bool:
        return self._completion is not None

    async def updates(self):
        """`ReplyReader.updates`, as the replica sends them. The reply ends at its "done" item:
        Ray's end of the stream, a round trip later, is not waited for (Serve's router, on its
        own loop, reads the call to its end and then counts the request finished)."""
        try:
            async for item in self._response:
                for token, piece, logprobs in item[1]:
                    self._started()
                    if logprobs is not None:
                        self.logprobs.append(logprobs)
                    yield token, piece
                if item[0] == "done":
                    self._end(item[2], item[3])
                    return
        except Exception as error:  # noqa: BLE001 (the replica died, or its engine refused)
            self._end(self._failed(f"the replica failed: {type(error).__name__}: {error}"), None)
        if self._completion is None:
            self._end(self._failed("the replica ended the reply without finishing it"), None)

    def result(self, timeout: float | None = None) -> Completion:
        """The Completion (the reply must have been read to its end, or cancelled)."""
        if self._completion is None:
            raise RuntimeError("read the reply (updates, texts) before its result")
        return self._completion

    def cancel(self) -> None:
        """End the call: the replica cancels the request."""
        self._response.cancel()
        if self._completion is None:
            self._end(self._failed("cancelled", reason="cancelled"), None)

    def _failed(self, message: str, reason: str = "error") -> Completion:
        return Completion(-1, self._ids, [], reason, Usage(len(self._ids)), error=message)

    def _started(self) -> None:
        if self._waiting:
            self._waiting = False
            self._replicas.started(self)

    def _end(self, completion: Completion, stats: dict | None) -> None:
        if self._completion is None:
            self._started()
            self._completion = completion
            self._replicas.finished(self, completion, stats)


class ReplicaSet:
    """The replicas' deployment seen as one engine by the server's app (`build_app`)."""

    def __init__(self, handle, config, block_size: int, first_stats: dict) -> None:
        # requests and replies over Serve's gRPC channel to the replicas, not Ray's object store:
        # a round trip less per request (the latency the Ray path adds, in docs/scale-out.md)
        self.handle = handle.options(stream=True, _by_reference=False)
        self.model = SimpleNamespace(config=config)  # what the app reads of the model
        self.limits = SimpleNamespace(block_size=block_size)
        self.store_tier = None  # (each replica has its own; their counters stay in the replicas)
        self.on_finish = None
        self._stats = {first_stats["replica"]: first_stats}
        self._lock = threading.Lock()
        self._open: set[ReplicaHandle] = set()
        self._waiting = 0
        self._stopping = threading.Event()

    # ---- what the app calls ------------------------------------------------------------------
    def submit(self, ids: list[int], params: SamplingParams, *, hints=None) -> ReplicaHandle:
        """Send a request of prompt `ids` to the replicas; RequestError when it cannot fit, or
        when it carries session hints (`kvcache.engine.sessions`: one engine's pool only)."""
        if hints is not None:
            raise RequestError("kv_hints and x-session-id are not served with --replicas: a session's "
                               "blocks are kept in one engine's pool; serve without --replicas to use them")
        check_request(ids, params, self.model.config, self.num_blocks * self.limits.block_size or None,
                      self.limits.block_size)
        handle = ReplicaHandle(self, ids, self.handle.generate.remote(ids, params))
        with self._lock:
            self._open.add(handle)
            self._waiting += 1
        return handle

    @property
    def num_blocks(self) -> int:
        """Blocks in one replica's pool (every replica's is the same)."""
        return max(stats["blocks_total"] for stats in self._stats.values())

    def capacity_by_kv_dtype(self, tokens: int) -> dict[str, int]:
        """{}: each replica sizes its own pool (`Engine.capacity_by_kv_dtype` there); the set
        reports no capacity of its own (the server then exports none)."""
        return {}

    @property
    def queue_depth(self) -> int:
        """Requests sent that have no token yet (queued on a replica, or routed)."""
        return self._waiting

    @property
    def running_in_background(self) -> bool:
        return not self._stopping.is_set()

    def stats(self) -> dict:
        """The server's gauges: requests waiting and running here, blocks summed over the
        replicas as each last reported them (after its latest reply)."""
        with self._lock:
            reported = list(self._stats.values())
            running = len(self._open) - self._waiting
        summed = {name: sum(stats[name] for stats in reported) for name in SUMMED}
        hit_rates = [stats["prefix_hit_rate"] for stats in reported]
        return {
            **summed, "waiting": self._waiting, "running": running,
            "kv_cache_utilization": summed["blocks_used"] / max(1, summed["blocks_total"]),
            "prefix_hit_rate": sum(hit_rates) / len(hit_rates), "replicas": len(reported),
        }

    def start(self) -> None:
        """Nothing to start: the replicas run their engines."""

    def run(self, until=None, started=None) -> None:
        """Wait until `until()` or `stop()` (the server's HTTP thread does the work)."""
        if started is not None:
            started()
        while not self._stopping.wait(0.1) and (until is None or not until()):
            pass

    def stop(self, timeout: float | None = None) -> None:
        self._stopping.set()

    def cancel_all(self) -> None:
        with self._lock:
            open_now = list(self._open)
        for handle in open_now:
            handle.cancel()

    def wake(self) -> None:
        """(Nothing sleeps here.)"""

    # ---- from the handles ----------------------------------------------------------------------
    def started(self, handle: ReplicaHandle) -> None:
        with self._lock:
            self._waiting -= 1

    def finished(self, handle: ReplicaHandle, completion: Completion, stats: dict | None) -> None:
        with self._lock:
            self._open.discard(handle)
            if stats is not None:
                self._stats[stats["replica"]] = stats
        if self.on_finish is not None:
            self.on_finish(completion)


def start_replicas(settings: ReplicaSettings, replicas: int, *, address: str | None = None,
                   max_ongoing: int = 256, policy: str = "prefix", imbalance: int = IMBALANCE) -> ReplicaSet:
    """Connect to the Ray cluster at `address` (None: start a local one), deploy `replicas`
    engine replicas built from `settings` and wait until they answer. policy: the router's
    ("prefix" or "round_robin"); imbalance: requests a replica holding a conversation's earlier
    turns may have over the least loaded replica's (`PrefixIndex.rank`: a shared prefix holds
    only up to min(imbalance, SHARED_IMBALANCE))."""
    block_size = settings.engine.get("pool", PoolConfig()).block_size
    ray.init(address=address, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"location": "NoServer"})  # the server is kvcache's own
    router = {"block_size": block_size, "policy": policy, "imbalance": imbalance}
    deployment = replica_deployment(replicas, max_ongoing, router)
    print(f"kvcache serve: starting {replicas} replicas on Ray Serve (each loads the model)…",
          file=sys.stderr, flush=True)
    handle = serve.run(deployment.bind(settings), name=APP, route_prefix=None)
    first = handle.stats.remote().result()
    config = handle.config.remote().result()
    return ReplicaSet(handle, config, block_size, first)


def stop_replicas(started_here: bool = True) -> None:
    """Shut down the local Ray cluster this process started (its replicas with it), or delete the
    replicas' application from a cluster that stays."""
    if not started_here:
        serve.delete(APP)
    ray.shutdown()
