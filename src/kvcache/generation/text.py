"""A reply's text, assembled token by token: the same pieces whether streamed or sent whole.

Decoding every token alone breaks characters that span tokens (byte-level BPE), and decoding
the whole reply at every token costs O(n²). `ReplyText` decodes a short window of recent
tokens (the offsets trick of incremental detokenizers), holds back a trailing partial character
and any tail that could still grow into a stop string, and cuts the reply before the first stop
string it contains (OpenAI's rule: the stop string is not returned). A reply that ends inside a
character (max_tokens reached between its bytes) ends before it: no half character is returned
as U+FFFD, streamed or whole.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


class ReplyText:
    """Feed token ids with `add`; each call returns the text that became final. `finish()`
    returns the rest. The pieces joined are the reply's text.

    tokenizer: has `decode(ids, skip_special_tokens=True)`. stop: strings that end the reply;
    the first one found, and everything after it, is not returned."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.hold = max((len(s) for s in self.stop), default=1) - 1  # chars a stop may still need
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already counted
        self.read = 0
        self.text = ""  # decoded so far (final pieces, not yet all sent)
        self.sent = 0  # characters of self.text already returned
        self.searched = 0  # characters of self.text no stop string starts in (a stop not yet whole)
        self.stopped = False

    def add(self, token: int) -> str:
        """Take one new token id; return the text that can be sent now (maybe "")."""
        if self.stopped:
            return ""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if after.endswith(REPLACEMENT) or len(after) <= len(before):
            return ""  # a character still incomplete: wait for the next token
        self.text += after[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The text not yet returned (the reply ended). Tokens that never completed a character
        give their whole characters; the incomplete one at the end (a decoder's U+FFFD) is dropped."""
        if not self.stopped and self.read < len(self.ids):  # a tail that never completed a character
            before = self._decode(self.ids[self.prefix : self.read])
            self.text += self._decode(self.ids[self.prefix :])[len(before) :].rstrip(REPLACEMENT)
            self.read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        cut = self._first_stop()
        if cut is not None:
            self.text, self.stopped, final = self.text[:cut], True, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        piece = self.text[self.sent : end]
        self.sent = end
        return piece

    def _first_stop(self) -> int | None:
        """Where the first stop string in the text starts (searched from where one could still
        start: each token's text is searched once, not the whole reply again), or None."""
        found = [index for index in (self.text.find(s, self.searched) for s in self.stop) if index >= 0]
        self.searched = max(self.searched, len(self.text) - self.hold)
        return min(found) if found else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
