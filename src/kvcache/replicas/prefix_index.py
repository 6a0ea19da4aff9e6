"""Which replica holds which prompt blocks, as a router sees it: the chained block hashes of
every prompt it sent to each replica (`kvcache.blocks.prefix_digests`, the hashes the replica's
pool finds blocks by), least recently used forgotten first, and which of them ended a prompt. A
prompt goes to the replica holding its longest run of leading blocks: a conversation's next turn
starts with the previous turn's prompt, so it returns to the replica that served it (its match
ends where that prompt ended), while a prefix that other conversations share and go past (a
system prompt) holds a prompt only while the loads are near. Standard library only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

#: requests a replica holding a conversation's earlier turns may have over the least loaded one's
#: (`rank`'s imbalance) by default: enough that a next turn stays with its replica when turns come
#: together (docs/scale-out.md compares 2 and 8)
IMBALANCE = 8
#: the most a match that ends inside others' prompts (a shared system prompt) may add: so new
#: conversations sharing one spread over the replicas instead of gathering where it was first sent
SHARED_IMBALANCE = 2


class PrefixIndex:
    """Block hashes per replica, at most `capacity` each (the oldest used forgotten first)."""

    def __init__(self, capacity: int = 65536) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.held: dict[Hashable, OrderedDict[bytes, bool]] = {}  # digest -> a prompt ended there

    def record(self, replica: Hashable, digests: Sequence[bytes]) -> None:
        """`replica` was sent a prompt of these leading block hashes: it holds them now."""
        held = self.held.setdefault(replica, OrderedDict())
        for position, digest in enumerate(digests, 1):
            held[digest] = held.get(digest, False) or position == len(digests)
            held.move_to_end(digest)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """`replica` is gone (its pool with it)."""
        self.held.pop(replica, None)

    def matched(self, replica: Hashable, digests: Sequence[bytes]) -> int:
        """Leading blocks of `digests` that `replica` holds."""
        held = self.held.get(replica)
        count = 0
        while held is not None and count < len(digests) and digests[count] in held:
            count += 1
        return count

    def rank(
        self, replicas: Sequence[Hashable], digests: Sequence[bytes], load: dict, imbalance: int
    ) -> list[list[Hashable]]:
        """`replicas` ranked for a prompt of these block hashes, best first: the one holding the
        most leading blocks (fewest queued requests among equals), unless its load exceeds the
        least loaded one's by more than `imbalance` requests (by more than SHARED_IMBALANCE, if
        less, where no prompt sent there ended at the match's last block: a prefix others share
        and go past); then, and for every other rank, fewest queued requests first. load:
        replica -> requests queued or running there."""
        if not replicas:
            return []
        by_load = sorted(replicas, key=lambda r: load.get(r, 0))
        lightest = load.get(by_load[0], 0)
        matched = {r: self.matched(r, digests) for r in by_load}
        best = max(by_load, key=matched.__getitem__)  # (the first of equals: load breaks ties)
        if matched[best] == 0:
            return [[r] for r in by_load]
        if not self.held[best][digests[matched[best] - 1]]:  # a shared prefix, not an earlier turn
            imbalance = min(imbalance, SHARED_IMBALANCE)
        if load.get(best, 0) - lightest > imbalance:
            return [[r] for r in by_load]
        return [[best]] + [[r] for r in by_load if r != best]
