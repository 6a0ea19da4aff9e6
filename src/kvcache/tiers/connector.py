"""The one interface between the engine's pool and the tiers below it, shaped after vLLM's KV
connector: the pool asks it at three points of a request's life and keeps nothing of its own.

- lookup, at submit (and after a preemption): how many of the prompt's whole blocks after those
  the pool holds the tiers have; the read starts off the step (`lookup`), and a request waits
  for it before it is admitted (`ready`); once answered, `matched` says the tokens it brought;
- load, before the step: into the row the pool reserved for an admitted request (`admit`), the
  blocks read that fall in the chunk the plan gave it (`load`), so prefill runs only the rest;
- save, after the step: the blocks that became whole are written behind (`save`, called from
  the observer hook `stepped`).

The connector keeps its own state for each request, by the request's id, until the request
lets go of it (`finished`). This class is the connector of no tiers: nothing is held, read or
written; `store_tier.TierConnector` is the one over a store. It is a `StepObserver` on the
engine's list, so the engine's warm-up (`warming`) and `close` reach it as they reach the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from kvcache.engine.observers import StepObserver


class KVConnector(StepObserver):
    """The tiers below the pool, as the pool sees them (see the module docstring); with no tiers
    every lookup finds nothing."""

    store = None  # the store the tiers read and write (`block_store.BlockStore`); None: no tiers

    def lookup(self, request_id: Hashable, digests: list[bytes], held: int, wake: Callable[[], None]) -> None:
        """At submit: start reading the blocks after the first `held` of a prompt's whole-block
        `digests` (those the pool holds), off the step; wake() when the answer comes. A read the
        request held before is replaced."""

    def ready(self, request_id: Hashable, held: Callable[[], int], wake: Callable[[], None]) -> bool:
        """Whether the request may be admitted now: no read of its blocks is on its way, and the
        one that came still follows the `held()` whole blocks the pool holds now (else a new read
        starts, and the request waits for it)."""
        return True

    def wait(self, request_id: Hashable, timeout_s: float) -> None:
        """Block until the request's read is answered, `timeout_s` at most (nothing to wait for:
        at once)."""

    def matched(self, request_id: Hashable) -> int:
        """The prompt tokens the request's read brought, in whole blocks (0: none, no answer, or
        no read)."""
        return 0

    def admit(self, request_id: Hashable) -> int:
        """The request is given a row: `matched`, after letting go of a read that brought none
        (its prefix may then attach part of a cached block; blocks to load start on a boundary)."""
        return 0

    def load(self, request_id: Hashable, cache, row: int, attached: int, end: int) -> int:
        """Before the step: append to row `row` of `cache` (holding `attached` tokens) the blocks
        the request's read brought that follow, up to position `end`; the tokens added."""
        return 0

    def save(self, cache) -> None:
        """After the step: write behind the whole blocks of `cache`'s rows the tiers have not seen."""

    def finished(self, request_ids) -> None:
        """These requests let go of what the connector kept for them (their rows were freed, or
        they left the queue)."""

    def pin(self, digests: list[bytes]) -> None:
        """Keep these blocks last when a tier evicts."""

    def unpin(self, digests: list[bytes]) -> None:
        """Undo one `pin` of these blocks."""

    def listen(self, events) -> None:
        """Publish the blocks the tiers write and remove to `events` (a `KVEventPublisher`), each
        in its tier's medium; with no tiers there are none."""

    def tier_stored(self, medium: str, keys: list[str]) -> None:
        """(a tier's thread; `block_store.TierListener`) the tier `medium` wrote these blocks."""

    def tier_removed(self, medium: str, keys: list[str]) -> None:
        """(a tier's thread) the tier `medium` evicted or deleted these blocks."""

    def stepped(self, cache) -> None:
        """The engine's step is over: `save` what it left in the pool."""
        self.save(cache)
