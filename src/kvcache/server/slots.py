"""llama-server's slot save, restore and erase, on the disk tier: a conversation's KV kept by name.

    POST /slots/{id}?action=save     {"messages": [...]} or {"prompt": text or token ids}
    POST /slots/{id}?action=restore  (no body)
    POST /slots/{id}?action=erase    (no body)

Save runs the conversation's prompt as a request of one token (its prefix found in the pool or
the tiers is attached, the rest computed), so every whole block of it reaches the disk tier
(`--kv-disk`) as the tier writes any block, in the tier's block files; it then waits for the
writes, pins those blocks on disk (evicted after every unpinned block, across restarts too: the
saved conversations are pinned again when the server starts) and writes the conversation's token
ids and cache salt under the id (`kvcache.tiers.saved_prompts`). Restore runs the saved prompt
the same way, so its blocks are read from disk into the pool (those the pool still holds are
attached): the next request that starts with that prompt finds them in memory. Erase unpins the
blocks (they stay in the tier, evicted as any other) and deletes the id. Only whole blocks are
kept; the tokens after the last one are computed again, as on any prefix hit.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvcache.blocks import salt_root
from kvcache.cache.paged.rows import attachable_blocks
from kvcache.generation.params import SamplingParams
from kvcache.server.fields import unsupported
from kvcache.server.openai_api import ApiError
from kvcache.tiers.block_codec import block_key
from kvcache.tiers.disk_store import DiskBlockStore
from kvcache.tiers.saved_prompts import MAX_SAVED, SavedPromptError, SavedPrompts, check_name
from kvcache.tiers.tiered_store import TieredStore

log = logging.getLogger("kvcache.server")
ACTIONS = ("save", "restore", "erase")
FLUSH_S = 30.0  # how long a save waits for the tier's writer to write the conversation's blocks


def read_action(query) -> str:
    """The `action` of a /slots/{id} request's query (save, restore or erase); ApiError(400) naming
    a missing or unknown action, or any other query parameter."""
    for name in query:
        if name != "action":
            raise ApiError(400, f"/slots/{{id}} takes one query parameter, action ({', '.join(ACTIONS)}), "
                           f"got {name!r}", param=name)
    action = query.get("action")
    if action not in ACTIONS:
        raise ApiError(400, f"action must be one of {', '.join(ACTIONS)} (/slots/{{id}}?action=save), "
                       f"got {action!r:.40}", param="action")
    return action


def read_slot_id(name: str) -> str:
    """`name` when it may name a saved conversation; ApiError(400) naming id_slot otherwise."""
    try:
        return check_name(name)
    except SavedPromptError as error:
        raise ApiError(400, str(error), param="id_slot") from None


def check_empty(body: object) -> None:
    """ApiError(400) unless a restore's or erase's body is nothing or an empty JSON object."""
    if body is None:
        return
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    if body:
        name = next(iter(body))
        raise ApiError(400, unsupported(name) + "; restore and erase take no fields", param=name)


def disk_tier(store) -> DiskBlockStore | None:
    """The disk tier among `store`'s (the store itself, or one of a `TieredStore`'s), or None."""
    tiers = store.tiers if isinstance(store, TieredStore) else [store]
    return next((tier for tier in tiers if isinstance(tier, DiskBlockStore)), None)


class Slots:
    """The saved conversations of `engine`'s disk tier (see the module docstring); the saved ones
    of this model are pinned on disk when made."""

    def __init__(self, engine, disk: DiskBlockStore) -> None:
        self.engine, self.disk = engine, disk
        self.connector = engine.store_tier
        self.cache = engine.pool.cache
        self.saved = SavedPrompts(disk.folder)
        self.block_size = engine.limits.block_size
        self.vocab = engine.model.config.vocab_size
        self.pinned: dict[str, list[bytes]] = {}  # name -> the digests its save (or the start) pinned
        self.lock = asyncio.Lock()  # one slot action at a time: pins stay counted right
        self._pin_saved()

    def _pin_saved(self) -> None:
        """Pin the blocks of every conversation saved for this model (at start)."""
        try:
            names = self.saved.names()[:MAX_SAVED]
        except (SavedPromptError, OSError) as error:  # (`slots` a link: each action then says so)
            log.warning("saved conversations not pinned: %s", error)
            names = []
        for name in names:
            try:
                tokens, salt = self._saved(name, self.saved.read(name))
            except (ApiError, SavedPromptError, OSError) as error:
                log.warning("saved conversation %r not pinned: %s", name, getattr(error, "message", error))
                continue
            digests = self._digests(tokens, salt)
            self.connector.pin(digests)
            self.pinned[name] = digests

    # ---- the actions -------------------------------------------------------------------------------
    async def save(self, name: str, ids: list[int], salt: str | None) -> dict:
        started = time.perf_counter()
        async with self.lock:
            if name not in self.pinned and len(self.saved.names()) >= MAX_SAVED:
                raise ApiError(400, f"this server keeps {MAX_SAVED} saved conversations at most: erase one "
                               "(POST /slots/{id}?action=erase) first", param="id_slot")
            digests = self._digests(ids, salt)
            self.connector.pin(digests)  # (before its blocks are written: none evicted meanwhile)
            try:
                await self._run(ids, salt)
                await asyncio.to_thread(self.connector.store.flush, FLUSH_S)
                held = self._held(digests)
                self.saved.write(name, {"format": "kvcache.saved_prompt", "version": 1,
                                        "namespace": self.connector.space, "cache_salt": salt, "tokens": ids})
            except BaseException:
                self.connector.unpin(digests)  # (what `name` saved before, if anything, stays pinned)
                raise
            self.connector.unpin(self.pinned.get(name, []))
            self.pinned[name] = digests
        return {"id_slot": name, "filename": name, "n_saved": held * self.block_size,
                "n_written": held * self.connector.layout.value_bytes, "n_prompt_tokens": len(ids),
                "timings": {"save_ms": _ms(started)}}

    async def restore(self, name: str) -> dict:
        started = time.perf_counter()
        async with self.lock:
            tokens, salt = self._saved(name, self._read(name))
            reused = self.cache.prefix_digests(tokens, salt_root(salt))  # (what a prefix hit may cover)
            in_memory = attachable_blocks(self.cache, reused)
            completion = await self._run(tokens, salt)
        restored = completion.usage.cached_tokens
        from_disk = max(0, restored // self.block_size - in_memory)
        return {"id_slot": name, "filename": name, "n_restored": restored,
                "n_read": from_disk * self.connector.layout.value_bytes, "n_prompt_tokens": len(tokens),
                "timings": {"restore_ms": _ms(started)}}

    async def erase(self, name: str) -> dict:
        async with self.lock:
            saved = self._read(name)
            self.connector.unpin(self.pinned.pop(name, []))
            self.saved.erase(name)
        tokens = saved.get("tokens")
        return {"id_slot": name, "n_erased": len(tokens) if isinstance(tokens, list) else 0}

    # ---- the parts ---------------------------------------------------------------------------------
    def _read(self, name: str) -> dict:
        """What was saved as `name`; ApiError(404) when nothing was, (400) for a file refused."""
        try:
            saved = self.saved.read(name)
        except SavedPromptError as error:
            raise ApiError(400, str(error), param="id_slot") from None
        if saved is None:
            raise ApiError(404, f"no conversation is saved as {name!r} (POST /slots/{{id}}?action=save saves "
                           "one)", param="id_slot", code="not_found")
        return saved

    def _saved(self, name: str, saved: dict | None) -> tuple[list[int], str | None]:
        """(token ids, cache salt) of a saved conversation, checked: written for this model and block
        layout, ids in the vocabulary; ApiError(400) otherwise."""
        if saved is None:
            raise ApiError(404, f"no conversation is saved as {name!r}", param="id_slot", code="not_found")
        if saved.get("namespace") != self.connector.space:
            raise ApiError(400, f"the conversation saved as {name!r} was saved for another model, dtype or "
                           "block size than this server's: it cannot be restored here", param="id_slot",
                           code="saved_for_another_model")
        tokens, salt = saved.get("tokens"), saved.get("cache_salt")
        context = self.engine.model.config.max_position_embeddings
        valid = isinstance(tokens, list) and 0 < len(tokens) < context
        if not valid or not all(type(t) is int and 0 <= t < self.vocab for t in tokens) or not (
                salt is None or isinstance(salt, str)):
            raise ApiError(400, f"the conversation saved as {name!r} is not one kvcache wrote (its token ids "
                           "or cache salt are not valid)", param="id_slot")
        return tokens, salt

    def _digests(self, tokens: list[int], salt: str | None) -> list[bytes]:
        """The digests of every whole block of `tokens` (the last one too: a later turn covers it)."""
        return self.cache.prefix_digests([*tokens, 0], salt_root(salt))

    def _held(self, digests: list[bytes]) -> int:
        """The leading blocks of `digests` the disk tier holds now."""
        count = 0
        for digest in digests:
            if not self.disk.holds(block_key(self.connector.space, digest)):
                break
            count += 1
        return count

    async def _run(self, tokens: list[int], salt: str | None):
        """Run `tokens` as a request of one greedy token under `salt`: its Completion; ApiError(503)
        when it was cancelled (the server stops), (500) when it failed."""
        handle = self.engine.submit(tokens, SamplingParams(max_tokens=1, temperature=0.0, cache_salt=salt))
        try:
            async for _ in handle.updates():
                pass
        finally:
            if not handle.done:
                handle.cancel()
        completion = handle.result()
        if completion.finish_reason == "cancelled":
            raise ApiError(503, "the request was cancelled (the server is shutting down)",
                           kind="server_error")
        if completion.finish_reason == "error":
            raise ApiError(500, f"the request failed inside the engine: {completion.error}",
                           kind="server_error")
        return completion


def _ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 3)
