"""`ReplicaSet` and `ReplicaHandle` without a cluster: a reply read from a replica's stream, as the
server reads it."""

from __future__ import annotations

import asyncio

from kvcache.engine.request import Completion, Usage
from kvcache.replicas.replica_set import ReplicaSet

STATS = {"replica": "a", "blocks_total": 8, "blocks_used": 1, "blocks_free": 7, "blocks_cached": 0,
         "preemptions": 0, "prefix_hit_rate": 0.0}


class Deployment:
    """A deployment handle whose `generate` streams `items`, then never ends its stream (as if
    Ray's end of the stream were still on its way)."""

    def __init__(self, items: list) -> None:
        self.items, self.generate = items, self
        self.options_asked: dict = {}

    def options(self, **options):
        self.options_asked = options
        return self

    def remote(self, ids, params):
        async def stream():
            for item in self.items:
                yield item
            await asyncio.Event().wait()

        return stream()


def read(replicas: ReplicaSet, ids: list[int]):
    async def whole():
        handle = replicas.submit(ids, None)
        pieces = [piece async for piece in handle.updates()]
        return pieces, handle.result()

    return asyncio.run(asyncio.wait_for(whole(), 60))  # a reply waiting on the end of the stream hangs


def test_a_reply_ends_at_its_done_item_without_waiting_for_the_end_of_the_stream(monkeypatch):
    monkeypatch.setattr("kvcache.replicas.replica_set.check_request", lambda *args: None)
    completion = Completion(3, [5, 6], [7, 8], "length", Usage(2, 0, 2))
    done = ("done", [(8, "b", None)], completion, {**STATS, "blocks_used": 2})
    deployment = Deployment([("pieces", [(7, "a", None)]), done])
    replicas = ReplicaSet(deployment, config=None, block_size=16, first_stats=STATS)

    pieces, result = read(replicas, [5, 6])

    assert pieces == [(7, "a"), (8, "b")]
    assert result is completion
    assert replicas.stats()["blocks_used"] == 2 and replicas.stats()["running"] == 0
    assert replicas.queue_depth == 0
    assert deployment.options_asked == {"stream": True, "_by_reference": False}  # Serve's gRPC channel


def test_each_tokens_logprobs_come_with_its_update(monkeypatch):
    from kvcache.generation.logprobs import TokenLogprobs

    monkeypatch.setattr("kvcache.replicas.replica_set.check_request", lambda *args: None)
    first, second = TokenLogprobs(7, -0.5, ((7, -0.5),)), TokenLogprobs(8, -1.5, ((3, -0.2),))
    completion = Completion(3, [5, 6], [7, 8], "length", Usage(2, 0, 2), logprobs=[first, second])
    done = ("done", [(8, "b", second), (None, "!", None)], completion, STATS)
    replicas = ReplicaSet(Deployment([("pieces", [(7, "a", first)]), done]), config=None, block_size=16,
                          first_stats=STATS)

    async def whole():
        handle = replicas.submit([5, 6], None)
        seen = [(token, len(handle.logprobs)) async for token, _ in handle.updates()]
        return seen, handle.logprobs

    seen, logprobs = asyncio.run(asyncio.wait_for(whole(), 60))
    assert seen == [(7, 1), (8, 2), (None, 2)] and logprobs == [first, second]
