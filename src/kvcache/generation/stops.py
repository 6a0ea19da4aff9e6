"""When each row of a generation stops: an EOS token, a stop string in its new text, or length."""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
        self.eos = {int(token) for token in eos_ids}  # ints (0-d tensors would hash by identity)
        self.pad_token_id = pad_token_id
        self.stop_strings = list(stop_strings or ())
        self.tokenizer = tokenizer
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
            if token in self.eos:
                self.reasons[row], self.finished[row] = "eos", True
            elif self.stop_strings and self._ends_with_stop(self.new_tokens[row]):
                self.reasons[row], self.finished[row] = "stop_string", True
        return chosen

    def _ends_with_stop(self, tokens: list[int]) -> bool:
        """Whether the text of the newest tokens contains a stop string (checked every step)."""
        longest = max(len(stop) for stop in self.stop_strings)
        text = self.tokenizer.decode(tokens[-(longest + 8) :])  # enough tokens to spell any stop string
        return any(stop in text for stop in self.stop_strings)
