"""Block bookkeeping for sliding-window layers: only the window's blocks stay held.

A query at position q sees positions in (q - window, q]. After positions up to L are written, the
next query (at L) and every later one needs none before L - window + 1, so each commit gives back
the blocks wholly before that (their table entries become HOLE; holes are always a prefix of the
table). A prefix hit attaches the same tokens as the cache's other layers, but takes only the blocks
still inside the window of its last attached position; the ones before are holes from the start.
Full blocks are hashed before they are given back, so a finished or later sequence can still find
them while they stay cached.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .allocator import HOLE, BlockAllocator, SequenceBlocks
from .errors import CacheConfigError, CacheCropError


class WindowedBlockAllocator(BlockAllocator):
    """A BlockAllocator whose sequences hold only the blocks their window still needs."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise CacheConfigError(f"window must be an int >= 1, got {window!r}")
        super().__init__(num_blocks, block_size)
        self.window = window

    def _first_needed(self, length: int) -> int:
        """The first block a sequence of `length` written positions still needs."""
        return max(0, length - self.window + 1) // self.block_size

    # ---- prefix hits: only the window's blocks ------------------------------------------------
    def attachable(self, digests: Sequence[bytes]) -> int:
        """The most leading blocks whose window part is cached (the blocks before it need not be)."""
        for count in range(len(digests), 0, -1):
            if self.can_attach(digests, count):
                return count
        return 0

    def _needed(self, digests: Sequence[bytes]) -> Sequence[bytes]:
        return digests[self._first_needed(len(digests) * self.block_size) :]

    def _attach(self, state: SequenceBlocks, digests: Sequence[bytes], partial: int = HOLE,
                within: int = 0) -> None:
        first = self._first_needed(len(digests) * self.block_size + within)
        for index, digest in enumerate(digests):
            state.hashes.append(digest)
            if index < first:
                state.table.append(HOLE)
            else:
                block = self._by_hash[digest]
                self._take(block)
                state.table.append(block)
        self._attach_part(state, partial, within)
        state.num_tokens = len(digests) * self.block_size + within

    # ---- giving back what the window left behind ------------------------------------------------
    def commit(self, seq_id: Hashable, num_tokens: int) -> None:
        """Record that positions up to `num_tokens` are written, then give back the blocks the
        window has moved past (hashed first, so they stay findable while cached)."""
        super().commit(seq_id, num_tokens)
        state = self.sequence(seq_id)
        for index in range(self._first_needed(state.num_tokens)):
            block = state.table[index]
            if block != HOLE:
                state.table[index] = HOLE
                self._release(block)

    def validate_truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Raise CacheCropError if the window of the kept positions reaches a block given back."""
        state = self.sequence(seq_id)
        if num_tokens >= state.num_tokens or num_tokens == 0:
            return
        first = self._first_needed(num_tokens)
        if state.table[first] == HOLE:
            raise CacheCropError(
                f"sequence {seq_id!r}: a sliding-window layer no longer holds positions before "
                f"{self._held_from(state)}; keeping {num_tokens} tokens needs positions from "
                f"{max(0, num_tokens - self.window + 1)} (window {self.window})"
            )

    def _held_from(self, state: SequenceBlocks) -> int:
        holes = next((index for index, block in enumerate(state.table) if block != HOLE), len(state.table))
        return holes * self.block_size

    def truncate(self, seq_id: Hashable, num_tokens: int) -> None:
        """Keep the first `num_tokens` positions (see validate_truncate: the window must still be held)."""
        self.validate_truncate(seq_id, num_tokens)
        super().truncate(seq_id, num_tokens)
