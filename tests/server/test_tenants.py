"""Per-tenant API keys (--api-keys FILE): one tenant's prefix never answers another's
cached_tokens, a request's own cache_salt parts its tenant's requests without reaching another
tenant's, /metrics answers admin keys only; a bad keys file is named by line; --require-cache-salt
refuses an unsalted request."""

from __future__ import annotations

import httpx
import pytest
from conftest import start_server

from kvcache.server import ServerSettings
from kvcache.server.tenants import api_keys, read_api_keys

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
KEYS = "# tenants\nalpha-key-not-secret alpha\n\nbeta-key-not-secret beta\nops-key-not-secret ops admin\n"


@pytest.fixture(scope="module")
def tenants_server(model, tokenizer, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEYS)
    running = start_server(model, tokenizer, ServerSettings(model_name="m", api_keys=api_keys(str(path))),
                           max_running=4, token_budget=128)
    yield running
    running.stop()


def _cached(server, key: str, prompt: list[int], salt: str | None = None) -> int:
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0, **({"cache_salt": salt} if salt else {})}
    response = httpx.post(f"{server.url}/completions", json=body, timeout=TIMEOUT,
                          headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_one_tenants_prefix_never_answers_another_tenants_cached_tokens(tenants_server):
    prompt = list(range(11, 70))
    assert _cached(tenants_server, "alpha-key-not-secret", prompt) == 0
    assert _cached(tenants_server, "beta-key-not-secret", prompt) == 0  # the same prompt, another tenant
    assert _cached(tenants_server, "alpha-key-not-secret", prompt) > 0  # its own prefix: shared
    assert _cached(tenants_server, "beta-key-not-secret", prompt) > 0


def test_a_requests_own_salt_combines_with_its_tenants_and_never_replaces_it(tenants_server):
    prompt = list(range(21, 80))
    assert _cached(tenants_server, "alpha-key-not-secret", prompt, salt="shared-name") == 0
    assert _cached(tenants_server, "alpha-key-not-secret", prompt) == 0  # its own salt parts alpha's requests
    assert _cached(tenants_server, "beta-key-not-secret", prompt, salt="shared-name") == 0  # not alpha's
    assert _cached(tenants_server, "alpha-key-not-secret", prompt, salt="shared-name") > 0


def test_metrics_answer_admin_keys_only(tenants_server):
    def metrics(key: str | None) -> httpx.Response:
        headers = {} if key is None else {"Authorization": f"Bearer {key}"}
        return httpx.get(f"{tenants_server.base}/metrics", headers=headers, timeout=TIMEOUT)

    assert metrics("ops-key-not-secret").status_code == 200
    refused = metrics("alpha-key-not-secret")
    assert refused.status_code == 403 and "admin key" in refused.json()["error"]["message"]
    assert metrics(None).status_code == 401 and metrics("wrong").status_code == 401
    models = httpx.get(f"{tenants_server.url}/models", timeout=TIMEOUT,
                       headers={"Authorization": "Bearer beta-key-not-secret"})
    assert models.status_code == 200


def test_the_api_key_joins_the_keys_file_as_an_admin_of_its_own(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("k1\nk2 team\nk3 team\n")
    keys = api_keys(str(path), "operator-key")
    k1, k2, k3, operator = (keys.tenant_of(key) for key in ("k1", "k2", "k3", "operator-key"))
    assert k2 == k3 and k2.salt(None) == k3.salt(None)  # keys of one name are one tenant
    assert len({k1.salt(None), k2.salt(None), operator.salt(None)}) == 3
    assert operator.admin and not (k1.admin or k2.admin) and keys.tenant_of("k4") is None


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("", "no keys"),
        ("a b c\n", "line 1: expected 'KEY', 'KEY NAME' or 'KEY NAME admin'"),
        ("a\nb c admin extra\n", "line 2"),
        ("a\na b\n", "line 2: this key is on an earlier line too"),
        ("a admin\n", "line 1: 'KEY admin' names a tenant 'admin'"),
        ("clé\n", "printable ASCII"),
    ],
)
def test_a_bad_keys_file_is_named_by_line(tmp_path, text, said):
    path = tmp_path / "keys.txt"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="--api-keys") as raised:
        read_api_keys(path)
    assert said in str(raised.value)


def test_require_cache_salt_refuses_an_unsalted_request_by_the_flags_name(model, tokenizer):
    running = start_server(model, tokenizer, ServerSettings(model_name="m", require_cache_salt=True),
                           max_running=2, token_budget=64)
    try:
        url, prompt = f"{running.url}/completions", list(range(5, 30))
        refused = httpx.post(url, json={"prompt": prompt, "max_tokens": 1}, timeout=TIMEOUT)
        assert refused.status_code == 400 and "--require-cache-salt" in refused.json()["error"]["message"]
        salted = httpx.post(url, json={"prompt": prompt, "max_tokens": 1, "cache_salt": "user-7"},
                            timeout=TIMEOUT)
        assert salted.status_code == 200
    finally:
        running.stop()
