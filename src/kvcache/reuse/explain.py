"""Why a prompt missed the prefix cache: a bounded record of the prompts a server has seen and of
what it held after each reply (their tokens and chained block hashes) and, for a new prompt, the
closest earlier one (longest common block-hash prefix, then tokens inside the first differing or
the last partial block), where the two part (token index, the chat segment holding it) and the
cause, told apart from what the server sees. Pure: it never touches a prompt's tokens, only reads
them."""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvcache.blocks.allocator import ROOT_HASH, common_prefix, prefix_digests

#: every cause `PrefixExplainer.explain` may give, in the order its checks run
CAUSES = (
    "hit",  # every token the prompt shares in length with an earlier one matched, and is still held
    "shorter_than_block",  # the prompt has no whole block a hit could cover
    "never_seen",  # no earlier prompt shares even its first block
    "cache_salt",  # an earlier prompt matches, under another cache_salt (or model fingerprint)
    "evicted",  # the matching blocks were seen but are held by no tier now
    "window",  # the match reaches past the sliding-window retention boundary
    "reasoning_rerendered",  # a think block dropped, added or rendered empty in the history
    "volatile_system_field",  # digits changed in the system prompt (a date, a time, a counter)
    "tools_reordered",  # the same tools, in another order
    "normalisation",  # the texts differ only in whitespace or letter case (roles included)
    "edited",  # the history itself changed (another message, another text)
)

THINK = re.compile(r"</?think>")
CONTEXT_TOKENS = 12  # tokens each side of the divergence `Explanation.context` decodes


@dataclasses.dataclass(frozen=True)
class Segment:
    """A part of a rendered chat prompt: name ('system', 'tools', 'message 3', 'reasoning',
    'generation prompt') and its token range [start, end)."""

    name: str
    start: int
    end: int


@dataclasses.dataclass(frozen=True)
class Explanation:
    """matched_tokens: leading tokens of the prompt's reusable part (all but its last token) shared
    with the closest earlier prompt (whole blocks by hash, then token by token inside the first
    differing block or the last partial one); first_divergent_token: the prompt's index where they
    part (None when nothing diverged); segment: the chat segment holding that index ('prompt' for a
    plain completion); cause: one of `CAUSES`; tier: for 'evicted', the tiers that were asked."""

    matched_tokens: int
    first_divergent_token: int | None
    segment: str
    cause: str
    tier: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class _Seen:
    tokens: list[int]
    digests: list[bytes]
    root: bytes
    segments: Iterable[Segment]  # a tuple, or read as far as needed (ChatSegments)
    reply: bool = False  # a prompt and the reply generated to it (what the server holds after it)


class PrefixExplainer:
    """Remembers the last `capacity` prompts and prompts with their replies (tokens, block hashes,
    salt root, segments) and explains a new prompt against them. block_size: the pool's; window:
    the tokens a hit may reuse at most (a sliding-window retention boundary; None: no bound);
    decode: token ids -> text, for the causes told apart by text (None: those become 'edited')."""

    def __init__(self, block_size: int, capacity: int = 256, window: int | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (prompts remembered), got {capacity}")
        self.block_size = block_size
        self.window = window
        self.decode = decode
        self._seen: collections.deque[_Seen] = collections.deque(maxlen=capacity)

    def __len__(self) -> int:
        return len(self._seen)

    def record(self, tokens: Sequence[int], root: bytes = ROOT_HASH,
               segments: Iterable[Segment] = ()) -> None:
        """Remember a prompt the server ran (the oldest is forgotten past `capacity`). segments: a
        list or tuple (copied), or an iterable read again at each later explanation that needs it
        (a lazy one, kvcache.server.why.ChatSegments)."""
        ids = [int(t) for t in tokens]
        self._remember(ids, prefix_digests(ids, self.block_size, root), root, segments)

    def explain(self, tokens: Sequence[int], root: bytes = ROOT_HASH, segments: Iterable[Segment] = (),
                held: Callable[[bytes], bool] | None = None, tiers: str = "memory") -> Explanation:
        """Why `tokens` (under salt `root`) did or did not match what the server holds. held(digest):
        whether some tier still holds that block (None: everything seen is held); tiers: the tiers
        `held` asks, named in an 'evicted' answer. segments: read only as far as the index named."""
        ids = [int(t) for t in tokens]
        return self._explain(ids, prefix_digests(ids, self.block_size, root), segments, held, tiers)

    def observe(self, tokens: Sequence[int], root: bytes = ROOT_HASH, segments: Iterable[Segment] = (),
                held: Callable[[bytes], bool] | None = None, tiers: str = "memory") -> Explanation:
        """`explain`, then `record` the prompt (its block hashes computed once)."""
        ids = [int(t) for t in tokens]
        digests = prefix_digests(ids, self.block_size, root)
        answer = self._explain(ids, digests, segments, held, tiers)
        self._remember(ids, digests, root, segments)
        return answer

    def record_reply(self, prompt: Sequence[int], reply: Sequence[int], root: bytes = ROOT_HASH,
                     segments: Iterable[Segment] = ()) -> None:
        """Remember what the server holds after generating `reply` to `prompt` (recorded before, with
        its `segments`): the prompt's tokens and the reply's but its last (sampled, never run: no
        keys or values of it are held), the reply a segment 'reply'. A next turn that sends the
        reply back is compared with it where it shares more tokens than with the prompt alone (at
        least the reply's first)."""
        ids = [int(t) for t in prompt] + [int(t) for t in reply][:-1]
        kept = tuple(segments) if isinstance(segments, (list, tuple)) else segments
        followed = _Followed(kept, Segment("reply", len(prompt), len(ids)))
        self._remember(ids, prefix_digests(ids, self.block_size, root), root, followed, reply=True)

    def _remember(self, ids: list[int], digests: list[bytes], root: bytes,
                  segments: Iterable[Segment], reply: bool = False) -> None:
        kept = tuple(segments) if isinstance(segments, (list, tuple)) else segments
        self._seen.append(_Seen(ids, digests, root, kept, reply))

    def _explain(self, ids: list[int], digests: list[bytes], segments: Iterable[Segment],
                 held: Callable[[bytes], bool] | None, tiers: str) -> Explanation:
        if not digests:
            return Explanation(0, None, _segment_at(segments, 0), "shorter_than_block")
        reusable = len(ids) - 1  # the last token is always run, for its logits
        closest, blocks, matched, rival = self._closest(ids[:reusable], digests)
        if closest is None:
            return self._unmatched(ids, segments)
        # nothing diverged where every token the two have in common matched: a repeat, or a prompt
        # that continues the earlier one whole (a chat's next turn)
        diverged = matched < min(reusable, len(closest.tokens))
        kept = blocks
        if held is not None:
            kept = next((index for index, digest in enumerate(digests[:blocks]) if not held(digest)), blocks)
        if kept < blocks:
            first = kept * self.block_size
            return Explanation(matched, first, _segment_at(segments, first), "evicted", tiers)
        if self.window is not None and matched > self.window:
            return Explanation(matched, self.window, _segment_at(segments, self.window), "window")
        if not diverged and rival is not None and self._reasoning_dropped(ids, rival, matched, segments):
            return Explanation(matched, matched, _segment_at(segments, matched), "reasoning_rerendered")
        if not diverged:
            return Explanation(matched, None, _segment_at(segments, matched), "hit")
        return Explanation(matched, matched, _segment_at(segments, matched),
                           self._cause(ids, closest, matched, segments))

    def _closest(self, ids: list[int], digests: list[bytes]) -> tuple[_Seen | None, int, int, _Seen | None]:
        """The remembered prompt sharing the most leading tokens with `ids` (a prompt's reusable
        part, whose whole blocks hash to `digests`) among those sharing a whole block with it, the
        newest of equals; with the whole blocks and the tokens it shares. After the shared blocks,
        tokens are compared one by one: in the first differing block or the last partial one, so
        never more than a block of them. A prompt with its reply is the closest only where it shares
        more tokens than any prompt (a history that holds none of the reply continues the prompt).
        Last: where a prompt is chosen, the newest prompt with its reply sharing as many tokens
        (None if none), whose reply `_reasoning_dropped` reads."""
        best, blocks, most = None, 0, (0, False)
        rival, rival_tokens = None, 0
        for seen in reversed(self._seen):
            shared = common_prefix(digests, seen.digests)
            if not shared:
                continue
            start = shared * self.block_size
            end = start + self.block_size
            tokens = start + common_prefix(ids[start:end], seen.tokens[start:end])
            if (tokens, not seen.reply) > most:
                best, blocks, most = seen, shared, (tokens, not seen.reply)
            if seen.reply and tokens > rival_tokens:
                rival, rival_tokens = seen, tokens
        tied = best is not None and not best.reply and rival_tokens == most[0]
        return best, blocks, most[0], rival if tied else None

    def _reasoning_dropped(self, ids: list[int], rival: _Seen, index: int,
                           segments: Iterable[Segment]) -> bool:
        """Whether the server's reply in `rival` (a prompt and its reply, sharing `index` tokens with
        `ids`) goes on at `index` with a reasoning block where the new prompt's segment there has
        none: a client that dropped the reasoning the reply opened with, under a template that
        renders nothing in its place."""
        if self.decode is None or index >= min(len(ids) - 1, len(rival.tokens)):
            return False
        mine = _segment_of(segments, index)
        new_text = self.decode(ids[index: mine.end] if mine else ids[index:])
        return self.decode(rival.tokens[index:]).lstrip().startswith("<think>") and not THINK.search(new_text)

    def _unmatched(self, ids: list[int], segments: Iterable[Segment]) -> Explanation:
        """No block of `ids` under its root was seen: another salt's prompt with its tokens, or none."""
        limit = self.block_size * ((len(ids) - 1) // self.block_size)
        for seen in reversed(self._seen):
            shared = min(common_prefix(ids, seen.tokens), limit)
            if shared >= self.block_size:
                return Explanation(0, 0, _segment_at(segments, 0), "cache_salt")
        return Explanation(0, 0, _segment_at(segments, 0), "never_seen")

    def _cause(self, ids: list[int], closest: _Seen, index: int, segments: Iterable[Segment]) -> str:
        """The cause of a divergence at `index` against `closest`, from the segment and the text."""
        mine = _segment_of(segments, index)
        theirs = _segment_of(closest.segments, index)
        new_part = ids[index: mine.end] if mine else ids[index:]
        old_part = closest.tokens[index: theirs.end] if theirs else closest.tokens[index:]
        if mine is not None and mine.name == "tools" and theirs is not None and theirs.name == "tools":
            new_tools, old_tools = ids[mine.start: mine.end], closest.tokens[theirs.start: theirs.end]
            if sorted(new_tools) == sorted(old_tools) or (self.decode is not None and sorted(
                    self.decode(new_tools)) == sorted(self.decode(old_tools))):
                return "tools_reordered"  # (by text too: a tokenizer merges across the tools' joints)
        if self.decode is None:
            return "edited"
        new_text, old_text = self.decode(new_part), self.decode(old_part)
        if (mine and mine.name == "reasoning") or THINK.search(new_text) or THINK.search(old_text):
            return "reasoning_rerendered"
        if _squeezed(new_text) == _squeezed(old_text):
            return "normalisation"
        if mine is not None and mine.name == "system" and _volatile(new_text, old_text):
            return "volatile_system_field"
        return "edited"


class _Followed:
    """A prompt's segments (re-iterable, perhaps read lazily) and then one more (its reply's)."""

    def __init__(self, segments: Iterable[Segment], last: Segment) -> None:
        self.segments, self.last = segments, last

    def __iter__(self) -> Iterator[Segment]:
        yield from self.segments
        yield self.last


def _segment_of(segments: Iterable[Segment], index: int) -> Segment | None:
    return next((segment for segment in segments if segment.start <= index < segment.end), None)


def _segment_at(segments: Iterable[Segment], index: int) -> str:
    found = _segment_of(segments, index)
    return "prompt" if found is None else found.name


def _squeezed(text: str) -> str:
    return "".join(text.split()).casefold()


def _volatile(new_text: str, old_text: str) -> bool:
    """Whether the two texts differ, and only where digits stand."""
    return new_text != old_text and re.sub(r"\d+", "#", new_text) == re.sub(r"\d+", "#", old_text)
