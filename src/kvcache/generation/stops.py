"""When a sequence stops: an EOS token, a stop string in its new text, or length."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvcache.generation.text import ReplyText


class StopRule:
    """When one sequence stops, an EOS id or a stop string in its new text, and that text, read
    once: `take(token)` returns the text that became final (`ReplyText`: whole characters, the
    reply cut before a stop string) and sets `reason` ("eos", "stop_string") when it stopped;
    `finish()` returns the rest.

    stop_strings: a string (one stop string, not its characters) or a sequence of them; each
    non-empty (ValueError otherwise); they need a tokenizer. text=True decodes the new tokens
    even without stop strings (a server streams them)."""

    def __init__(
        self,
        eos_ids: Sequence[int],
        stop_strings: Sequence[str] | str | None = None,
        tokenizer=None,
        *,
        text: bool = False,
    ) -> None:
        self.eos = {int(token) for token in eos_ids}  # ints (0-d tensors would hash by identity)
        self.stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings or ())
        for stop in self.stop_strings:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"a stop string must be a non-empty str, got {stop!r}")
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer to read the generated text")
        wanted = (self.stop_strings or text) and tokenizer is not None
        self.text = ReplyText(tokenizer, tuple(self.stop_strings)) if wanted else None
        self.reason: str | None = None

    def take(self, token: int) -> str:
        """Read the sequence's next token; the text that became final (maybe "")."""
        piece = "" if self.text is None else self.text.add(token)
        if token in self.eos:
            self.reason = "eos"
        elif self.text is not None and self.text.stopped:
            self.reason = "stop_string"
        return piece

    def finish(self) -> str:
        """The text not yet returned (the sequence ended)."""
        return "" if self.text is None else self.text.finish()


class Stops:
    """The new tokens of `batch` rows and whether each has stopped ("eos", "stop_string", "grammar":
    its structured output complete; else "length"). A stopped row's later tokens are `pad_token_id`.
    grammars: each row's `structured.GrammarState`, which follows its tokens (None: no grammar)."""

    def __init__(
        self,
        batch: int,
        eos_ids: Sequence[int],
        pad_token_id: int,
        stop_strings: Sequence[str] | None,
        tokenizer,
        grammars: Sequence | None = None,
    ) -> None:
        self.rules = [StopRule(eos_ids, stop_strings, tokenizer) for _ in range(batch)]
        self.grammars = grammars
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
            rule = self.rules[row]
            rule.take(token)
            grammar = None if self.grammars is None else self.grammars[row]
            if grammar is not None:
                grammar.take(token)
            if rule.reason is not None:
                self.reasons[row], self.finished[row] = rule.reason, True
            elif grammar is not None and grammar.done:
                self.reasons[row], self.finished[row] = "grammar", True
        return chosen
