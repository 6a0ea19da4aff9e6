"""Prefix reuse on a `PagedCache`: prompts that start like an earlier one skip its prefill.

Two ways in:

    server = PrefixCache(model, num_blocks=512)          # automatic: send the whole history
    result = server.generate(history_ids, max_new_tokens=64)
    result.reused_tokens, result.prefilled_tokens         # found in cache / run through the model

    chat = ChatSession(model, tokenizer, num_blocks=512)  # a kept session: send the new message
    reply = chat.send("Hello!")

The automatic path finds the longest run of cached full blocks matching the prompt (hashes
chained from the first token), attaches them and prefills only the rest; finished requests
leave their full blocks cached until the pool needs the room. A session keeps its row between
turns, so everything it holds is reused, not only full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvcache.cache.paged import PagedCache
from kvcache.cache.paged.rows import prefill_inputs
from kvcache.generation import GenerationResult, generate

_TURN = "turn"  # what a ChatSession's reads from its store tier are kept by (one turn at a time)


@dataclass
class PrefixResult:
    """One request: the generation result, and how its prompt was served."""

    result: GenerationResult
    reused_tokens: int  # prompt tokens attached from cached blocks (no forward)
    prefilled_tokens: int  # prompt tokens run through the model

    @property
    def new_tokens(self) -> list[int]:
        return self.result.new_tokens[0]


def new_cache(
    model, num_blocks: int, block_size: int = 16, kv_dtype: str | None = None, kv_window: int = 0
) -> PagedCache:
    """A PagedCache for `model` (its layers, heads, dtype and device), its rows stored as kv_dtype
    says ("bfloat16", "int8", "int4" …: `PagedCache`; None: in the model's dtype), the last
    kv_window tokens also in the model's dtype (`PagedCache`)."""
    return PagedCache(num_blocks, block_size, config=model.config, dtype=model.dtype, device=model.device,
                      kv_dtype=kv_dtype, kv_window=kv_window)


class PrefixCache:
    """Requests served from one pool of blocks: a prompt's cached prefix is attached, not
    recomputed. Each call is one request (or a batch of them); its row is freed at the end,
    its full blocks staying cached for the next prompts that start the same way.

    Args:
        model: a kvcache `LlamaForCausalLM`.
        cache: the PagedCache to use, or None to make one of num_blocks × block_size.
    """

    def __init__(self, model, cache: PagedCache | None = None, *, num_blocks: int = 256,
                 block_size: int = 16) -> None:
        self.model = model
        self.cache = cache if cache is not None else new_cache(model, num_blocks, block_size)

    def generate(self, prompt: Sequence[int], **options: Any) -> PrefixResult:
        """Generate after `prompt` (token ids); options go to `kvcache.generate`."""
        return self.generate_batch([prompt], **options)[0]

    def generate_batch(self, prompts: Sequence[Sequence[int]], **options: Any) -> list[PrefixResult]:
        """Generate after each prompt in one batch; each row reuses its own cached prefix."""
        cache = self.cache
        if cache.rows:
            raise ValueError("the cache holds rows of another request; PrefixCache owns its cache")
        try:
            reused = [cache.add_sequence([int(t) for t in prompt]) for prompt in prompts]
            rest = [list(prompt)[count:] for prompt, count in zip(prompts, reused)]
            input_ids, attention_mask = prefill_inputs(cache, rest)
            result = generate(self.model, input_ids, attention_mask, cache=cache, **options)
            for row, tokens in enumerate(result.new_tokens):
                cache.declare_tokens(row, tokens)  # generated blocks become findable too
        finally:
            cache.free_rows()
        return [
            PrefixResult(_row(result, row), count, len(tail))
            for row, (count, tail) in enumerate(zip(reused, rest))
        ]


def _row(result: GenerationResult, row: int) -> GenerationResult:
    if len(result.new_tokens) == 1:
        return result
    return GenerationResult(
        sequences=result.sequences[row : row + 1],
        new_tokens=[result.new_tokens[row]],
        stop_reasons=[result.stop_reasons[row]],
        prompt_length=result.prompt_length,
        time_to_first_token_s=result.time_to_first_token_s,
        decode_time_s=result.decode_time_s,
        decode_steps=result.decode_steps,
    )


class ChatSession:
    """A conversation kept in one row of a PagedCache: each turn runs only what is new.

    `send_ids(conversation_ids)` takes the whole conversation's token ids (history and new
    turn), runs only what the cache lacks and generates the reply; `send(text)` renders the
    conversation with the tokenizer's chat template and sends it the same way. If a re-rendered
    history no longer starts with the tokens held (some templates rewrite earlier turns), the
    cache is cropped to the common prefix.

    Args:
        model: a kvcache `LlamaForCausalLM`; tokenizer: a kvcache Tokenizer (for `send`).
        cache: a PagedCache (a row is added for this session), or None to make one.
        system: an optional system message for `send`.
        kv_store: a tier below the cache (`kvcache.tiers.disk_store.DiskBlockStore`, …): a turn's
            prefix blocks the cache lacks are read from it, and the conversation's blocks written
            to it, so a conversation that starts the same way in a later process reuses them.
        kv_dtype: what the made cache stores rows as ("bfloat16", "int8", "int4" …; `PagedCache`);
            kv_window: its full-precision window of recent tokens (`PagedCache`).
        options: defaults for `kvcache.generate` (max_new_tokens, eos_token_id, …).
    """

    def __init__(self, model, tokenizer=None, *, cache: PagedCache | None = None, num_blocks: int = 256,
                 block_size: int = 16, system: str | None = None, kv_store=None, kv_dtype: str | None = None,
                 kv_window: int = 0, **options: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        if cache is None:
            cache = new_cache(model, num_blocks, block_size, kv_dtype, kv_window)
        self.cache = cache
        if self.cache.rows:
            raise ValueError("ChatSession needs a cache with no rows (it owns row 0)")
        self.cache.add_sequence()
        self.store_tier = None
        if kv_store is not None:
            from kvcache.tiers.store_tier import TierConnector

            self.store_tier = TierConnector(kv_store, model, self.cache)
        self.options = options
        self.messages: list[dict[str, str]] = []
        if system is not None:
            self.messages.append({"role": "system", "content": system})
        self.token_ids: list[int] = []  # every token of the conversation so far
        self.prefilled_tokens = 0  # tokens run through the model as prompt, over all turns
        self.last_turn = (0, 0)  # the latest turn's (tokens reused from the cache, tokens prefilled)
        self.last_result: GenerationResult | None = None  # the latest turn's generation

    @property
    def held_tokens(self) -> int:
        """Tokens whose keys and values the cache holds (all but the newest reply token)."""
        return self.cache.row_lengths[0]

    def send_ids(self, conversation_ids: Sequence[int], **options: Any) -> list[int]:
        """Continue the conversation whose token ids are now `conversation_ids` (the history
        so far plus the new turn); return the reply's token ids."""
        conversation_ids = [int(t) for t in conversation_ids]
        held = self.held_tokens
        known = self.token_ids[:held]
        common = 0
        for mine, theirs in zip(known, conversation_ids):
            if mine != theirs:
                break
            common += 1
        if common == len(conversation_ids):  # nothing new: recompute the last token
            common -= 1
        if common < held:
            self.cache.crop(common)
        self.cache.declare_tokens(0, conversation_ids[common:], start=common)
        loaded = self._load_from_store(conversation_ids, common)
        new = conversation_ids[common + loaded :]
        ids = torch.tensor([new], dtype=torch.long, device=self.model.device)
        result = generate(self.model, ids, cache=self.cache, **{**self.options, **options})
        reply = result.new_tokens[0]
        self.cache.declare_tokens(0, reply)
        if self.store_tier is not None:
            self.store_tier.save(self.cache)  # the conversation's new full blocks, written behind
        self.token_ids = conversation_ids + reply
        self.prefilled_tokens += len(new)
        self.last_turn = (common + loaded, len(new))
        self.last_result = result
        return reply

    def _load_from_store(self, conversation_ids: list[int], held: int) -> int:
        """Append to the row (holding `held` tokens, all declared) the blocks of the conversation
        the store holds after them, read now (a turn waits for its own prefix); the tokens added."""
        size = self.cache.block_size
        if self.store_tier is None or held % size:
            return 0
        digests = self.cache.prefix_digests(conversation_ids)
        tiers = self.store_tier
        tiers.lookup(_TURN, digests, held // size, lambda: None)
        tiers.wait(_TURN, tiers.store.timeout_s)
        try:
            return tiers.load(_TURN, self.cache, 0, held, len(digests) * size)
        finally:
            tiers.finished([_TURN])

    def send(self, text: str, **options: Any) -> str:
        """Add a user message, generate the reply, return its text (special tokens skipped).
        options: `kvcache.generate`'s (a `streamer` sees each token as it is made). If the turn
        fails or is interrupted, the message is taken back and the conversation stays as it was."""
        if self.tokenizer is None:
            raise ValueError("send(text) needs a tokenizer; use send_ids with token ids")
        self.messages.append({"role": "user", "content": text})
        try:
            ids = self.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
            reply = self.send_ids(_as_list(ids), **options)
        except BaseException:
            self.messages.pop()
            raise
        text_out = self.tokenizer.decode(reply, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text_out})
        return text_out

    def close(self) -> None:
        """Release the session's row (its full blocks stay cached for later prompts); blocks
        queued for the store are written first (within a bound)."""
        if self.store_tier is not None:
            self.store_tier.store.flush(10.0)
        self.cache.free_rows()


def _as_list(ids) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)
