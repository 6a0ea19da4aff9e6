"""llama-server's /slots/{id}?action=save|restore|erase on a live server with a disk tier (--kv-disk):
a conversation saved, the server restarted (its pool empty), restored from disk into memory, then
asked again finds its prompt cached and answers the cold run's greedy tokens; saved blocks outlast
the disk tier's eviction until erased; every refusal is a JSON error naming the field, the id or
the flag; with tenants, only admin keys reach them."""

from __future__ import annotations

import stat

import httpx
import pytest
from conftest import API_KEY, start_server

from kvcache.blocks import ROOT_HASH
from kvcache.server import ServerSettings
from kvcache.server.tenants import api_keys
from kvcache.tiers.block_codec import block_key
from kvcache.tiers.disk_store import DiskBlockStore

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What does a KV cache keep between steps?"}]
SETTINGS = ServerSettings(model_name="kvcache-test", api_key=API_KEY, max_body_bytes=64 << 10)


def _disk_server(model, tokenizer, folder, max_bytes: int = 8 << 30):
    return start_server(model, tokenizer, SETTINGS, kv_store=DiskBlockStore(folder, max_bytes=max_bytes),
                        num_blocks=64, max_running=4, token_budget=128)


def _stop(running) -> None:
    running.stop()
    running.engine.close()  # (the disk folder unlocked for the next server)


def _slot(running, name: str, action: str | None, body=None, params=None) -> httpx.Response:
    query = {"action": action} if action is not None else {}
    options = {} if body is None else {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(f"{running.base}/slots/{name}", params={**query, **(params or {})}, headers=AUTH,
                      timeout=TIMEOUT, **options)


def _chat(running, **fields) -> dict:
    body = {"model": "kvcache-test", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, **fields}
    response = httpx.post(f"{running.url}/chat/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def _error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    return error


def _keys(running, ids: list[int]) -> list[str]:
    """The disk tier's keys of every whole block of `ids`."""
    space = running.engine.store_tier.space
    digests = running.engine.pool.cache.prefix_digests([*ids, 0], ROOT_HASH)
    return [block_key(space, digest) for digest in digests]


def _ids(running) -> list[int]:
    response = httpx.post(f"{running.base}/tokenize", json={"messages": MESSAGES}, headers=AUTH,
                          timeout=TIMEOUT)
    return response.json()["tokens"]


def test_a_conversation_saved_then_restored_after_a_restart_is_cached_and_answers_as_cold(
        model, tokenizer, tmp_path):
    running = _disk_server(model, tokenizer, tmp_path)
    try:
        cold = _chat(running, cache_salt="a cold run: no block of it cached")
        assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        ids = _ids(running)
        saved = _slot(running, "conv-1", "save", {"messages": MESSAGES})
        assert saved.status_code == 200, saved.text
        saved = saved.json()
        value_bytes = running.engine.store_tier.layout.value_bytes
        whole = len(ids) // 8 * 8
        assert saved["id_slot"] == saved["filename"] == "conv-1" and saved["n_prompt_tokens"] == len(ids)
        assert saved["n_saved"] == whole and saved["n_written"] == whole // 8 * value_bytes
        assert saved["timings"]["save_ms"] > 0
        assert stat.S_IMODE((tmp_path / "slots" / "conv-1.json").stat().st_mode) == 0o600
    finally:
        _stop(running)
    running = _disk_server(model, tokenizer, tmp_path)  # a new pool: the memory copy is gone
    try:
        restored = _slot(running, "conv-1", "restore")
        assert restored.status_code == 200, restored.text
        restored = restored.json()
        reusable = (len(ids) - 1) // 8 * 8  # (a request computes its last token at least)
        assert restored["n_restored"] == reusable and restored["n_read"] == reusable // 8 * value_bytes
        assert restored["id_slot"] == "conv-1" and restored["timings"]["restore_ms"] > 0
        read_before = running.engine.stats()["kv_store"]["hit_blocks"]
        warm = _chat(running)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= reusable > 0  # (+ its last block)
        assert running.engine.stats()["kv_store"]["hit_blocks"] == read_before  # from memory: restored
        assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    finally:
        _stop(running)


def test_saved_blocks_outlast_the_disk_tiers_eviction_across_a_restart_until_erased(model, tokenizer,
                                                                                    tmp_path):
    block_file = 4 * 4 * 32 * 2 * 4 * 8 + 64  # (the bundled model's block of 8 tokens, and its header)
    running = _disk_server(model, tokenizer, tmp_path, max_bytes=10 * block_file)  # 10 blocks
    fillers = [f"filler {index}: the quick brown fox jumps over the lazy dog, again and again. " * 2
               for index in range(8)]  # 10 blocks each

    def fill(start: int) -> None:  # (new prompts each time: the tier is written only blocks it never saw)
        for filler in fillers[start : start + 4]:
            response = httpx.post(f"{running.url}/completions", headers=AUTH, timeout=TIMEOUT,
                                  json={"prompt": filler, "max_tokens": 1, "temperature": 0})
            assert response.status_code == 200, response.text
        store.flush(TIMEOUT)

    try:
        keys = _keys(running, _ids(running))
        assert _slot(running, "kept", "save", {"messages": MESSAGES}).json()["n_saved"] == len(keys) * 8
    finally:
        _stop(running)
    running = _disk_server(model, tokenizer, tmp_path, max_bytes=10 * block_file)  # (pinned again at start)
    store = running.engine.store_tier.store
    try:
        fill(0)
        assert all(store.holds(key) for key in keys)  # pinned: evicted after every other block
        filler_keys = _keys(running, tokenizer.encode(fillers[0]))
        assert not any(store.holds(key) for key in filler_keys)  # (the tier did evict)
        erased = _slot(running, "kept", "erase")
        assert erased.status_code == 200
        assert erased.json() == {"id_slot": "kept", "n_erased": len(_ids(running))}
        assert not (tmp_path / "slots" / "kept.json").exists()
        _error(_slot(running, "kept", "restore"), 404, "id_slot")
        _error(_slot(running, "kept", "erase"), 404, "id_slot")
        fill(4)
        assert not any(store.holds(key) for key in keys)  # unpinned: evicted as any other
    finally:
        _stop(running)


@pytest.fixture(scope="module")
def disk_server(model, tokenizer, tmp_path_factory):
    running = _disk_server(model, tokenizer, tmp_path_factory.mktemp("kv-disk"))
    yield running
    _stop(running)


@pytest.mark.parametrize("action, params, param", [
    (None, {}, "action"),
    ("load", {}, "action"),
    ("save", {"filename": "x.bin"}, "filename"),
])
def test_a_missing_or_unknown_action_or_query_parameter_is_a_400_naming_it(disk_server, action, params,
                                                                           param):
    error = _error(_slot(disk_server, "conv", action, {"messages": MESSAGES}, params), 400, param)
    assert "action" in error["message"]


@pytest.mark.parametrize("name", ["...", ".hidden", "a..b", "x" * 129, "a%20b", "%2e%2e"])
def test_an_id_that_is_not_a_plain_name_is_a_400_naming_id_slot(disk_server, name):
    _error(_slot(disk_server, name, "save", {"messages": MESSAGES}), 400, "id_slot")


@pytest.mark.parametrize("body, param", [
    ({"messages": MESSAGES, "max_tokens": 4}, "max_tokens"),
    ({"messages": MESSAGES, "prompt": "hi"}, "prompt"),
    ({}, "messages"),
    ({"messages": "not a list"}, "messages"),
    ({"prompt": [1, 2, 10 ** 9]}, None),
    ({"prompt": "hi", "model": "another"}, "model"),
])
def test_a_bad_save_body_is_a_400_naming_the_field(disk_server, body, param):
    status = 404 if param == "model" else 400
    _error(_slot(disk_server, "conv", "save", body), status, param)
    assert not (disk_server.engine.store_tier.store.folder / "slots" / "conv.json").exists()


def test_restoring_or_erasing_an_unknown_id_is_a_404_and_a_body_field_a_400(disk_server):
    assert _error(_slot(disk_server, "never-saved", "restore"), 404, "id_slot")["code"] == "not_found"
    _error(_slot(disk_server, "never-saved", "erase"), 404, "id_slot")
    _error(_slot(disk_server, "never-saved", "restore", {"filename": "x.bin"}), 400, "filename")


def test_a_prompt_of_token_ids_saves_and_restoring_what_the_pool_holds_reads_nothing(disk_server):
    ids = _ids(disk_server)
    assert _slot(disk_server, "ids", "save", {"prompt": ids}).json()["n_saved"] == len(ids) // 8 * 8
    restored = _slot(disk_server, "ids", "restore").json()
    assert restored["n_restored"] >= (len(ids) - 1) // 8 * 8 > 0 and restored["n_read"] == 0


def test_without_a_disk_tier_slots_are_a_501_naming_the_flag(server):
    error = _error(_slot(server, "conv", "save", {"messages": MESSAGES}), 501, "action")
    assert "--kv-disk" in error["message"] and error["code"] == "kv_disk_needed"


def test_slots_take_post_only_and_need_the_key(disk_server):
    response = httpx.get(f"{disk_server.base}/slots/conv", params={"action": "save"}, timeout=TIMEOUT)
    assert response.status_code == 405 and response.json()["error"]["code"] == "method_not_allowed"
    response = httpx.post(f"{disk_server.base}/slots/conv", params={"action": "erase"}, timeout=TIMEOUT)
    assert response.status_code == 401


def test_with_tenants_slots_take_admin_keys_only(model, tokenizer, tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("alpha-key-not-secret alpha\nops-key-not-secret ops admin\n")
    settings = ServerSettings(model_name="kvcache-test", api_keys=api_keys(str(keys)))
    running = start_server(model, tokenizer, settings, kv_store=DiskBlockStore(tmp_path / "kv"),
                           num_blocks=64, max_running=4, token_budget=128)
    try:
        def save(key: str) -> httpx.Response:
            return httpx.post(f"{running.base}/slots/conv", params={"action": "save"}, timeout=TIMEOUT,
                              json={"messages": MESSAGES}, headers={"Authorization": f"Bearer {key}"})

        refused = save("alpha-key-not-secret")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "admin_key_needed"
        assert save("ops-key-not-secret").json()["n_saved"] > 0
    finally:
        _stop(running)
