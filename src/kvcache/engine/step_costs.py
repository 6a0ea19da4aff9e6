"""What the engine's steps cost, learned as they run, and the prompt tokens a step may carry beside
decoding rows so that it costs at most `factor` times a step of the batch's decoding rows alone.

A long prompt must not freeze everyone's stream: while rows decode, each step runs at most
`prefill_cap(rows, batch)` of its tokens. The cap is measured, not fixed: a step of R decoding
rows is learned as `decode_seconds(R)` (a moving average per row count), a prompt token's share
of a step as `token_seconds` (a step's seconds beyond its decode rows' estimate, over its prompt
tokens), and the cap is (factor - 1) · decode_seconds(batch) / token_seconds, so a model, a dtype
and a machine each get their own. `batch` is the rows that will decode once the prompts being
prefilled and waiting have joined: a step is held to the cost of the batch being formed, not of
the few rows decoding while the others wait (a cap measured on those would admit the others at a
trickle, and they would decode in small batches for long). A row count not measured yet is
estimated from the nearest one measured, each further row costing about a prompt token. Until a
token's cost is measured the cap is `initial`. It learns as an observer of the engine's steps
(`observers`: `ran`, and `restarted` after the warm-up), on the engine's one list.
"""

from __future__ import annotations

from kvcache.engine.observers import StepObserver

#: weight of a new observation in the moving averages
_NEW = 0.2


class StepCosts(StepObserver):
    """Moving averages of step costs (see the module docstring). factor: a step with prompt tokens
    costs at most this many decode-only steps (None: no cap, only the token budget bounds a step);
    initial, minimum, maximum: the cap before it is measured, and its bounds (at least a few
    tokens, so a prompt always moves on)."""

    def __init__(
        self, factor: float | None = 2.0, initial: int = 32, minimum: int = 8, maximum: int = 1 << 30
    ) -> None:
        if factor is not None and factor <= 1:
            raise ValueError(f"factor must be > 1 (a step with prompt tokens costs more), got {factor}")
        self.factor, self.initial, self.minimum, self.maximum = factor, initial, minimum, maximum
        self.restarted()

    def restarted(self) -> None:
        """Measure afresh: drop every cost learned so far (the engine's warm-up's steps)."""
        self.decode: dict[int, float] = {}  # rows -> seconds of a step of only those decode rows
        self.token_seconds: float | None = None  # what one prompt token adds to a step

    def ran(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
        """One step's forward: `decode_rows` rows of one token, `prompt_tokens` prompt tokens."""
        if prompt_tokens == 0:
            if decode_rows:
                self.decode[decode_rows] = _averaged(self.decode.get(decode_rows), seconds)
            return
        beside = self.decode_seconds(decode_rows) if decode_rows else 0.0
        if beside is None:
            return  # a mixed step before its rows' own cost is known says nothing of a token's
        share = max(seconds - beside, 0.0) / prompt_tokens
        self.token_seconds = _averaged(self.token_seconds, share)

    def decode_seconds(self, rows: int) -> float | None:
        """The learned seconds of a step of `rows` decode rows, or None before any: the nearest
        row count measured, plus a prompt token's cost for each row it lacks."""
        if not self.decode:
            return None
        nearest = min(self.decode, key=lambda seen: (abs(seen - rows), seen))
        more = max(rows - nearest, 0) * (self.token_seconds or 0.0)
        return self.decode[nearest] + more

    def prefill_cap(self, decode_rows: int, batch: int | None = None) -> int | None:
        """Prompt tokens a step beside `decode_rows` decoding rows may run (None: no cap, the
        factor being None); batch: the rows that will decode once the prompts prefilling and
        waiting have joined (default decode_rows)."""
        if self.factor is None:
            return None
        decode = self.decode_seconds(max(decode_rows, batch or 0))
        if decode is None or not self.token_seconds:
            cap = self.initial
        else:
            cap = round((self.factor - 1) * decode / self.token_seconds)
        return max(self.minimum, min(self.maximum, cap))


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else (1 - _NEW) * average + _NEW * value
