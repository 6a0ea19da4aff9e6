"""Ray Serve's request router for engine replicas: a prompt goes to the replica that holds the
longest run of its leading blocks (`prefix_index`), so a conversation's next turn finds its
earlier turns in that replica's pool; requests queued on each replica break ties, and past
`imbalance` more than the lightest one's (SHARED_IMBALANCE for a prefix conversations share)
they override a match. Runs where the deployment's handle is (the server's process); imports
Ray."""

from __future__ import annotations

import logging

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from kvcache.blocks import prefix_digests, salt_root
from kvcache.replicas.prefix_index import IMBALANCE, PrefixIndex

logger = logging.getLogger(__name__)


class PrefixAffinityRouter(RequestRouter):
    """Set on the replicas' deployment (`RequestRouterConfig`); `initialize_state` takes its
    `request_router_kwargs`."""

    def initialize_state(self, block_size: int = 16, imbalance: int = IMBALANCE, capacity: int = 65536,
                         policy: str = "prefix", **kwargs) -> None:
        """block_size: the replicas' pool's; imbalance: queued requests a conversation's earlier
        turns may add over the lightest replica's (`PrefixIndex.rank`); capacity: block hashes
        kept per replica; policy: "prefix" or "round_robin" (what the benchmark compares
        against)."""
        self.block_size, self.imbalance, self.policy = block_size, imbalance, policy
        self.index = PrefixIndex(capacity)
        self.turn = 0

    def _digests(self, pending_request: PendingRequest | None) -> list[bytes] | None:
        """The prompt's block hashes, for a `generate(ids, params)` call; None for other calls."""
        args = [] if pending_request is None else pending_request.args
        if len(args) != 2 or not isinstance(args[0], list):
            return None
        return prefix_digests(args[0], self.block_size, salt_root(getattr(args[1], "cache_salt", None)))

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        """The candidates ranked, best first (see the module docstring). Should the ranking fail,
        every candidate is ranked alike (Ray then takes the least loaded) and the error is logged:
        a router that raises leaves Ray Serve's request waiting for ever."""
        try:
            return self._ranked(candidate_replicas, pending_request)
        except Exception:  # noqa: BLE001 (logged; the request is still routed)
            logger.exception("kvcache's prefix router failed; this request is routed by load alone")
            return [list(candidate_replicas)]

    def _ranked(self, candidate_replicas: list[RunningReplica],
                pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        by_id = {replica.replica_id: replica for replica in candidate_replicas}
        ids = sorted(by_id, key=lambda r: r.to_full_id_str())
        digests = self._digests(pending_request)
        if self.policy == "round_robin" and ids:
            self.turn += 1
            ranked = [[r] for r in ids[self.turn % len(ids):] + ids[: self.turn % len(ids)]]
        else:
            cache = self.replica_queue_len_cache
            load = {r: cache.get(r) or 0 for r in ids}  # (requests on each, as Ray last probed)
            ranked = self.index.rank(ids, digests or [], load, self.imbalance)
        return [[by_id[r] for r in rank] for rank in ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        """The replica holds the prompt's blocks now (they are computed there if it lacked them)."""
        digests = self._digests(pending_request)
        if digests is not None:
            self.index.record(replica_id, digests)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        """Its pool went with it: nothing is held there any more."""
        super().on_replica_actor_died(replica_id)
        self.index.forget(replica_id)
