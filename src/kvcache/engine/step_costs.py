"""What the engine's steps cost, learned as they run, and the prompt tokens a step may carry beside
decoding rows so that it costs at most `factor` times a step of those rows alone.

A long prompt must not freeze everyone's stream: while rows decode, each step runs at most
`prefill_cap(rows)` of its tokens. The cap is measured, not fixed: a step of R decoding rows is
learned as `decode_seconds(R)` (a moving average per row count), a prompt token's share of a
step as `token_seconds` (a step's seconds beyond its decode rows' estimate, over its prompt
tokens), and the cap is (factor - 1) · decode_seconds(R) / token_seconds, so a model, a dtype and
a machine each get their own. Until both are measured the cap is `initial`.
"""

from __future__ import annotations

#: weight of a new observation in the moving averages
_NEW = 0.2


class StepCosts:
    """Moving averages of step costs (see the module docstring). factor: a step with prompt tokens
    costs at most this many decode-only steps; initial, minimum, maximum: the cap before it is
    measured, and its bounds (at least a few tokens, so a prompt always moves on)."""

    def __init__(
        self, factor: float = 2.0, initial: int = 32, minimum: int = 8, maximum: int = 1 << 30
    ) -> None:
        if factor <= 1:
            raise ValueError(f"factor must be > 1 (a step with prompt tokens costs more), got {factor}")
        self.factor, self.initial, self.minimum, self.maximum = factor, initial, minimum, maximum
        self.decode: dict[int, float] = {}  # rows -> seconds of a step of only those decode rows
        self.token_seconds: float | None = None  # what one prompt token adds to a step

    def record(self, decode_rows: int, prompt_tokens: int, seconds: float) -> None:
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
        """The learned seconds of a step of `rows` decode rows (the nearest row count measured),
        or None before any."""
        if not self.decode:
            return None
        return self.decode[min(self.decode, key=lambda seen: (abs(seen - rows), seen))]

    def prefill_cap(self, decode_rows: int) -> int:
        """Prompt tokens a step beside `decode_rows` decoding rows may run."""
        decode = self.decode_seconds(decode_rows)
        if decode is None or not self.token_seconds:
            cap = self.initial
        else:
            cap = int((self.factor - 1) * decode / self.token_seconds)
        return max(self.minimum, min(self.maximum, cap))


def _averaged(average: float | None, value: float) -> float:
    return value if average is None else (1 - _NEW) * average + _NEW * value
