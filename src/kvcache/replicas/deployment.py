"""One engine replica as a Ray Serve deployment: it loads the model, runs an `Engine` on a thread
of its own and streams each request's reply back to the server (`replica_set`). Imports Ray."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ray import serve

from kvcache.generation.params import SamplingParams


@dataclass(frozen=True)
class ReplicaSettings:
    """What every replica is built from: the model's folder or GGUF file (a path each Ray node
    can read), its dtype, torch threads per replica, the Engine's keyword arguments (its `pool`
    and `scheduler` configs among them), and how products with GGUF blocks read activations
    (`load_model`'s activations)."""

    model: str
    dtype: str | None = None
    threads: int = 1
    engine: dict = field(default_factory=dict)
    activations: str = "float32"


class EngineReplica:
    """Ray Serve calls `generate` for each request; `stats` and `check_health` otherwise."""

    def __init__(self, settings: ReplicaSettings) -> None:
        import torch

        from kvcache.engine import Engine
        from kvcache.model import load_model
        from kvcache.text.tokenizer import load_tokenizer

        torch.set_num_threads(settings.threads)
        model = load_model(settings.model, dtype=settings.dtype, activations=settings.activations)
        self.engine = Engine(model, load_tokenizer(settings.model), **settings.engine)
        self.engine.warm_up()
        self.engine.start()
        self.name = f"{os.uname().nodename}:{os.getpid()}"

    async def generate(self, ids: list[int], params: SamplingParams):
        """Stream ("pieces", [(token, text, its TokenLogprobs or None), …]) as tokens come, then
        ("done", [the pieces left], Completion, stats). Pieces that come once the request has
        finished travel with "done": every item is a round trip through Ray, and a short reply is
        then one item."""
        handle = self.engine.submit(ids, params)
        try:
            pending: list[tuple[int | None, str, object]] = []
            made = 0  # tokens so far: the index of the next one's logprobs
            async for token, piece in handle.updates():
                asked = token is not None and params.logprobs is not None
                pending.append((token, piece, handle.logprobs[made] if asked else None))
                made += token is not None
                if not handle.done:  # more will come later: send what is here now
                    yield ("pieces", pending)
                    pending = []
            yield ("done", pending, handle.result(), self.stats())
        finally:  # the server cancelled the call (its client left), or the reply ended
            if not handle.done:
                handle.cancel()

    def config(self):
        """The model's config (the server reads its context and vocabulary from it)."""
        return self.engine.model.config

    def stats(self) -> dict:
        """The engine's `stats()` and this replica's name."""
        return {**self.engine.stats(), "replica": self.name}

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop stopped is restarted."""
        if not self.engine.running_in_background:
            raise RuntimeError("the engine's loop has stopped")


def replica_deployment(replicas: int, max_ongoing: int, router_kwargs: dict):
    """The deployment of `replicas` EngineReplicas behind `router.PrefixAffinityRouter`, each
    taking up to `max_ongoing` requests at once (its engine queues what it cannot run yet)."""
    from ray.serve.config import RequestRouterConfig

    from kvcache.replicas.router import PrefixAffinityRouter

    return serve.deployment(
        EngineReplica,
        name="kvcache-engine",
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing,
        ray_actor_options={"num_cpus": 0},  # a replica's threads are set by ReplicaSettings.threads
        health_check_period_s=2,
        request_router_config=RequestRouterConfig(
            request_router_class=PrefixAffinityRouter, request_router_kwargs=router_kwargs
        ),
    )
