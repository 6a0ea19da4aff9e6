"""`kvcache serve` as a process with --api-keys and a --kv-budget that holds less than the model's
context: each tenant's prefix is its own and /metrics answers admin keys only; the start-up line
and the errors say the context comes from the KV pool and name --kv-budget; a bad keys file is
named before the model loads."""

from __future__ import annotations

import httpx
import pytest
from serve_process import start_serve, stop_serve

from kvcache.cli import main

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
KEYS = "alpha-key-not-secret alpha\nbeta-key-not-secret beta\nops-key-not-secret ops admin\n"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, start-up stdout line 2+) of `serve --kv-budget 1MiB --api-keys FILE` on the bundled
    model (context 1024 tokens; 1MiB holds 256 of them)."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(KEYS)
    keys.chmod(0o600)
    process, base = start_serve("--kv-budget", "1MiB", "--api-keys", str(keys))
    try:
        yield process, base
    finally:
        if process.poll() is None:
            stop_serve(process)


def _post(base: str, key: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=TIMEOUT)


def test_api_keys_give_each_tenant_its_own_prefix_and_metrics_to_admins(served):
    _, base = served
    body = {"prompt": list(range(30, 90)), "max_tokens": 2, "temperature": 0}

    def cached(key: str) -> int:
        response = _post(base, key, body)
        assert response.status_code == 200, response.text
        return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("alpha-key-not-secret") == 0
    assert cached("beta-key-not-secret") == 0
    assert cached("alpha-key-not-secret") > 0
    auth = {"Authorization": "Bearer beta-key-not-secret"}
    assert httpx.get(f"{base}/metrics", headers=auth, timeout=TIMEOUT).status_code == 403
    auth = {"Authorization": "Bearer ops-key-not-secret"}
    assert httpx.get(f"{base}/metrics", headers=auth, timeout=TIMEOUT).status_code == 200


def test_a_context_the_pool_limits_is_said_at_start_and_in_errors_naming_kv_budget(served):
    process, base = served
    lines = []  # the start-up lines after the address, to the last: "  --kv-budget … holds …"
    while not lines or not lines[-1].startswith("  --kv-budget"):
        lines.append(process.stdout.readline())
        assert lines[-1], lines  # (stdout still open: the lines come before the server answers)
    said = next((line for line in lines if line.startswith("  context:")), lines)
    assert "256 tokens" in said and "--kv-budget 1 MiB" in said
    assert "the model's context of 1024 tokens needs about --kv-budget 4MiB" in said
    long = _post(base, "alpha-key-not-secret", {"prompt": list(range(5, 305)), "max_tokens": 1})
    message = long.json()["error"]["message"]
    assert long.status_code == 400 and "--max-prompt-tokens" not in message
    pool = "what the KV pool holds at --kv-budget 1 MiB"
    assert f"limit of 255 (the context of 256 tokens less one; {pool}" in message
    near = _post(base, "alpha-key-not-secret", {"prompt": list(range(5, 205)), "max_tokens": 100})
    message = near.json()["error"]["message"]
    assert near.status_code == 400 and "model's" not in message.split(";")[0]
    assert f"this server's maximum context length is 256 tokens ({pool}" in message


def test_a_bad_api_keys_file_is_named_before_the_model_loads(tmp_path, capsys):
    keys = tmp_path / "keys.txt"
    keys.write_text("one two three\n")
    # a model path that does not exist: had it been loaded first, that would be the error
    assert main(["serve", "-m", str(tmp_path / "absent"), "--port", "0", "--api-keys", str(keys)]) == 2
    assert f"--api-keys {keys}, line 1" in capsys.readouterr().err
