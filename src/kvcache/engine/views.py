"""What the scheduler sees of the engine: its running and waiting requests as plain records
(`RunningSeq`, `WaitingSeq`), read from the requests and the pool."""

from __future__ import annotations

from collections.abc import Iterable

from kvcache.cache import PagedCache
from kvcache.engine.request import Request
from kvcache.engine.scheduler import RunningSeq, WaitingSeq


def running_view(running: list[Request], pool: PagedCache) -> list[RunningSeq]:
    """The running requests, in the order of the pool's rows, with the full-attention blocks each
    holds and could free (the sliding layers' blocks never run short: `paged_pool` sizes them)."""
    full = pool.full_allocator
    return [
        RunningSeq(
            request.id,
            request.arrival,
            len(request.tokens),
            request.cached,
            0 if full is None else len(full.sequence(seq).table),
            0 if full is None else full.unshared_blocks(seq),
        )
        for request, seq in zip(running, pool.rows)
    ]


def waiting_view(
    waiting: Iterable[Request], pool: PagedCache, prefix_caching: bool, cap: int
) -> list[WaitingSeq]:
    """The first `cap` waiting requests (no more could join in one step), each with the tokens
    the prefix cache would attach and the idle cached blocks attaching them would take. A
    request's prefix hashes are kept on it while its tokens stay the same."""
    seen = []
    for request in waiting:
        if len(seen) >= cap:
            break
        prefix, idle = (0, 0)
        if prefix_caching:
            if request.digests is None or request.digests[0] != len(request.tokens):
                request.digests = (len(request.tokens), pool.prefix_digests(request.tokens))
            prefix, idle = pool.prefix_cost(request.tokens, request.digests[1])
        seen.append(WaitingSeq(request.id, request.arrival, len(request.tokens), prefix, idle))
    return seen
