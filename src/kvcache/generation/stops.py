"""When a sequence stops: an EOS token, a stop string in its new text, or length."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class StopRule:
    """The stop conditions of one sequence: EOS ids, and stop strings (read with `tokenizer`).

    stop_strings: a string (one stop string, not its characters) or a sequence of them; each
    non-empty (ValueError otherwise)."""

    def __init__(
        self, eos_ids: Sequence[int], stop_strings: Sequence[str] | str | None = None, tokenizer=None
    ) -> None:
        self.eos = {int(token) for token in eos_ids}  # ints (0-d tensors would hash by identity)
        self.stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or ())
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"a stop string must be a non-empty str, got {stop!r}")
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the generated text")
        self.tokenizer = tokenizer
        # enough tokens to spell any stop string: a byte-level token is at least one byte, and
        # the window may start inside a character (up to 3 bytes of it), so bytes + 4 and a margin
        self.window = max((len(stop.encode("utf-8")) for stop in self.stop_strings), default=0) + 8

    def reason(self, new_tokens: list[int]) -> str | None:
        """ "eos" or "stop_string" when the newest of `new_tokens` stops the sequence, else None."""
        if new_tokens[-1] in self.eos:
            return "eos"
        if self.stop_strings:
            text = self.tokenizer.decode(new_tokens[-self.window :])
            if any(stop in text for stop in self.stop_strings):
                return "stop_string"
        return None


class Stops:
    """The new tokens of `batch` rows and whether each has stopped ("eos", "stop_string"; else
    "length"). A stopped row's later tokens are `pad_token_id`."""

    def __init__(
        self,
        batch: int,
        eos_ids: Sequence[int],
        pad_token_id: int,
        stop_strings: Sequence[str] | None,
        tokenizer,
    ) -> None:
        self.rule = StopRule(eos_ids, stop_strings, tokenizer)
        self.pad_token_id = pad_token_id
        self.finished = [False] * batch
        self.reasons = ["length"] * batch
        self.new_tokens: list[list[int]] = [[] for _ in range(batch)]

    @property
    def all_done(self) -> bool:
        return all(self.finished)

    def take(self, chosen: torch.Tensor) -> torch.Tensor:
        """Record one step's chosen tokens (B,); return the step's tokens (B,), pad where a row
        had stopped before this step."""
        listed = chosen.tolist()
        if any(self.finished):
            listed = [self.pad_token_id if done else token for token, done in zip(listed, self.finished)]
            chosen = torch.tensor(listed, dtype=torch.long, device=chosen.device)
        for row, token in enumerate(listed):
            if self.finished[row]:
                continue
            self.new_tokens[row].append(token)
            reason = self.rule.reason(self.new_tokens[row])
            if reason is not None:
                self.reasons[row], self.finished[row] = reason, True
        return chosen
