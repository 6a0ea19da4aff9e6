"""Session hints through the server on the bundled model: kv_hints in the body or the x-session-id
header (through the openai client's extra_body and extra_headers) give the answer a request
without them gives and keep the session; a bad hint is a 400 naming its field."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import API_KEY

pytestmark = [pytest.mark.kernels, pytest.mark.processes]

TIMEOUT = 60.0
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three prime numbers."}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def ask(client, **extra):
    answer = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=8,
                                            temperature=0, **extra)
    return answer.choices[0].message.content


def test_hints_in_the_body_or_the_header_keep_the_session_and_change_no_answer(client, server):
    plain = ask(client)
    pinned = ask(client, extra_body={"kv_hints": {"session_id": "agent-1", "pin": {"ttl_s": 60},
                                                  "retain": {"priority": 2}, "prefetch": True}})
    header = ask(client, extra_headers={"x-session-id": "agent-2"})
    assert plain == pinned == header
    sessions = {session_id for _, session_id in server.engine.sessions.live}
    assert {"agent-1", "agent-2"} <= sessions
    released = ask(client, extra_body={"kv_hints": {"session_id": "agent-1", "release": True}})
    assert released == plain
    assert "agent-1" not in {session_id for _, session_id in server.engine.sessions.live}


@pytest.mark.parametrize("hints, headers, named", [
    ({"session_id": "a", "pin": {"ttl_s": 0}}, {}, "kv_hints.pin.ttl_s"),
    ({"session_id": "a", "retain": {"priority": "high"}}, {}, "kv_hints.retain.priority"),
    ({"session_id": "a", "demote": {"destination": "disk"}}, {}, "kv_hints.demote.destination"),
    ({"session_id": "a", "flush": True}, {}, "kv_hints.flush"),
    ({"session_id": "a"}, {"x-session-id": "b"}, "kv_hints.session_id"),
    ({"pin": {"ttl_s": 5}}, {}, "kv_hints needs a session"),
])
def test_a_bad_hint_is_a_400_naming_its_field(server, hints, headers, named):
    body = {"model": "kvcache-test", "messages": MESSAGES, "max_tokens": 2, "kv_hints": hints}
    reply = httpx.post(f"{server.url}/chat/completions", json=body, timeout=TIMEOUT,
                       headers={"Authorization": f"Bearer {API_KEY}", **headers})
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]["message"]
