"""What watches the engine's steps without steering them: the counters (`metrics`), the measured
step costs (`step_costs`), the drift probe, the KV events, the store tier's writes. The engine
keeps one list of them and calls every one at each point of a step, so the step has no branch
per feature and no feature's own code: a feature that is off is simply not on the list.

Each hook is a no-op here; an observer overrides the ones it needs. The order of a step:
`admitted` (requests given rows, after the pool applied the plan), `applied` (the step's work
and the rows now running), `ran` (the forward's row and token counts and seconds, when it did
not fail), `forwarded` (after the forward's keys and values were committed, before sampling),
`delivered` (the step's new tokens were streamed), `preempted` (requests whose rows were taken
back to be recomputed later), `released` (requests whose rows were freed: finished, cancelled,
failed or preempted), `stepped` (after the step's tokens were delivered, before its finished
requests retire), `completed` (the Completions of the requests that ended), `step_ended`
(always, last, even when the step raised); `restarted` when the engine's counters start again
(after a warm-up), `close` when the engine closes. `warming` is the context the engine's warm-up
runs in (`Engine.warming`): an observer that must act otherwise meanwhile returns its own.
"""

from __future__ import annotations

import contextlib


class StepObserver:
    """One thing that watches the engine's steps (see the module docstring)."""

    def admitted(self, requests: list) -> None:
        """`requests` (engine `Request`s) were just given rows of the pool."""

    def applied(self, work, running: list) -> None:
        """The pool applied the step's plan: `work` (`pool.StepWork`: its batch, its rows'
        requests, the prompt tokens each admitted request attached and each row loaded from the
        store, by request id); `running`: the requests holding rows now, in row order."""

    def ran(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """The step's forward ran (and did not fail): `decode_rows` rows of one token and
        `prompt_tokens` tokens of prompt chunks, in `seconds`."""

    def forwarded(self, work, logits) -> None:
        """The step's forward ran: `work` (`pool.StepWork`: its batch and its rows' requests),
        `logits` (sampled rows, vocab) float32; its keys and values are committed."""

    def delivered(self, tokens: int) -> None:
        """The step's sampling rows' `tokens` new tokens were streamed to their requests."""

    def preempted(self, requests: list) -> None:
        """The rows of `requests` were taken back; they wait to be recomputed from their tokens."""

    def released(self, requests: list) -> None:
        """The rows of `requests` were freed (they finished, or were preempted)."""

    def stepped(self, cache) -> None:
        """The step's tokens were delivered; `cache` is the pool's PagedCache as the step left it."""

    def completed(self, completions: list) -> None:
        """These requests ended: their `Completion`s (each with its finish reason)."""

    def step_ended(self) -> None:
        """The step is over (called even when it raised)."""

    def warming(self) -> contextlib.AbstractContextManager:
        """The context the engine's warm-up requests run in (here: nothing changes)."""
        return contextlib.nullcontext()

    def restarted(self) -> None:
        """Count and measure afresh from now (the engine's warm-up is over)."""

    def close(self) -> None:
        """The engine is closing: let go of what this observer holds (sockets, connections)."""
