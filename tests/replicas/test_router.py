"""The prefix router's ranking as Ray Serve calls it, without a cluster: a failing ranking still
routes the request (Ray Serve leaves a request whose router raised waiting for ever)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import SimpleNamespace

from kvcache.generation.params import SamplingParams
from kvcache.replicas.router import PrefixAffinityRouter


@dataclass(frozen=True)
class ReplicaID:
    name: str

    def to_full_id_str(self) -> str:
        return self.name


class Router(PrefixAffinityRouter):
    replica_queue_len_cache = {}  # (Ray's queue lengths: none known)

    def __init__(self) -> None:  # (Ray's own state is not needed to rank)
        self.initialize_state(block_size=4)


class BrokenIndex:
    def rank(self, *args):
        raise RuntimeError("a bug in the index")


def ranked(router: Router, candidates: list, ids: list[int]) -> list[list[str]]:
    request = SimpleNamespace(args=[ids, SamplingParams()])
    ranks = asyncio.run(router.choose_replicas(candidates, request))
    return [[replica.replica_id.name for replica in rank] for rank in ranks]


def test_a_prompt_goes_first_to_the_replica_holding_its_blocks_and_a_failing_ranking_to_all(caplog):
    candidates = [SimpleNamespace(replica_id=ReplicaID(name)) for name in ("a", "b")]
    router = Router()
    prompt = list(range(12))
    router.on_request_routed(SimpleNamespace(args=[prompt, SamplingParams()]), ReplicaID("b"), None)
    assert ranked(router, candidates, prompt + [99])[0] == ["b"]

    router.index = BrokenIndex()
    assert ranked(router, candidates, prompt) == [["a", "b"]]
    assert "routed by load alone" in caplog.text
