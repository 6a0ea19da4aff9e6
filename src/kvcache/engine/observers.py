"""What watches the engine's steps without steering them: the drift probe, the KV events, the
store tier's writes. The engine keeps one list of them and calls every one at each point of a
step, so the step has no branch per feature: a feature that is off is simply not on the list.

Each hook is a no-op here; an observer overrides the ones it needs. The order of a step:
`admitted` (requests given rows, after the pool applied the plan), `forwarded` (after the
forward's keys and values were committed, before sampling), `released` (requests whose rows
were freed: finished, cancelled, failed or preempted), `stepped` (after the step's tokens were
delivered, before its finished requests retire), `step_ended` (always, last, even when the step
raised); `close` when the engine closes.
"""

from __future__ import annotations


class StepObserver:
    """One thing that watches the engine's steps (see the module docstring)."""

    def admitted(self, requests: list) -> None:
        """`requests` (engine `Request`s) were just given rows of the pool."""

    def forwarded(self, work, logits) -> None:
        """The step's forward ran: `work` (`pool.StepWork`: its batch and its rows' requests),
        `logits` (sampled rows, vocab) float32; its keys and values are committed."""

    def released(self, requests: list) -> None:
        """The rows of `requests` were freed (they finished, or were preempted)."""

    def stepped(self, cache) -> None:
        """The step's tokens were delivered; `cache` is the pool's PagedCache as the step left it."""

    def step_ended(self) -> None:
        """The step is over (called even when it raised)."""

    def close(self) -> None:
        """The engine is closing: let go of what this observer holds (sockets, connections)."""
