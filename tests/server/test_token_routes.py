"""llama-server's and vLLM's token routes on a live server, and errors outside the routes:
/tokenize and /detokenize round-trip, /apply-template and tokenized messages are what the chat
route renders, bad ids and bodies are 400s naming the field, the chat route's key, body and
message limits and queue bound hold, /v1/models carries the server's context, an unknown route or
method is a JSON 404 / 405, a refused field is a 400 the official client raises by name."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import API_KEY, start_server, wait_for

from kvcache.server import ServerSettings

pytestmark = pytest.mark.kernels  # (the fast lane, pytest --fast, leaves it out)

TIMEOUT = 60.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is a class?"}]
FAIL_IDS = [0, 0, 0, 0, 0, 0, 0]  # what FailingTokenizer cannot decode


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key=API_KEY, timeout=TIMEOUT, max_retries=0)


def _post(server, path: str, body, headers=AUTH) -> httpx.Response:
    options = {"content": body} if isinstance(body, bytes) else {"json": body}
    return httpx.post(server.base + path, headers=headers, timeout=TIMEOUT, **options)


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_tokenize_then_detokenize_gives_the_text_back(server, tokenizer):
    text = "The with statement, in Python: a context manager's __enter__ and __exit__."
    llama = _post(server, "/tokenize", {"content": text}).json()  # llama-server's: no special tokens
    assert llama["tokens"] == tokenizer.encode(text, add_special_tokens=False) and llama["count"] > 5
    assert llama["max_model_len"] == server.engine.model.config.max_position_embeddings
    vllm = _post(server, "/tokenize", {"prompt": text, "model": "kvcache-test"}).json()  # vLLM's: added
    assert vllm["tokens"] == tokenizer.encode(text, add_special_tokens=True)
    special = _post(server, "/tokenize", {"content": text, "add_special": True}).json()
    assert special["tokens"] == vllm["tokens"]
    back = _post(server, "/detokenize", {"tokens": llama["tokens"]}).json()
    assert back == {"content": text, "prompt": text}
    assert _post(server, "/detokenize", {"tokens": []}).json()["content"] == ""


def test_apply_template_and_tokenized_messages_are_what_the_chat_route_renders(server, client, tokenizer):
    prompt = _post(server, "/apply-template", {"messages": MESSAGES}).json()["prompt"]
    assert prompt == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = _post(server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert ids == tokenizer.encode(prompt, add_special_tokens=False)
    chat = client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=6,
                                          temperature=0)
    assert chat.usage.prompt_tokens == len(ids)
    same = client.completions.create(model="kvcache-test", prompt=ids, max_tokens=6, temperature=0)
    assert same.choices[0].text == chat.choices[0].message.content
    bare = _post(server, "/apply-template", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert prompt.startswith(bare["prompt"]) and len(bare["prompt"]) < len(prompt)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [5, -1]}, "tokens"),
    ("/detokenize", {"tokens": [5, 49152]}, "tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens"),
    ("/detokenize", {"tokens": "5 6"}, "tokens"),
    ("/detokenize", {"tokens": [5], "skip_special_tokens": True}, "skip_special_tokens"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "x", "prompt": "y"}, "prompt"),
    ("/tokenize", {"content": "x", "add_special": "yes"}, "add_special"),
    ("/tokenize", {"content": "x", "add_special": True, "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"content": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"content": "x", "with_pieces": True}, "with_pieces"),
    ("/tokenize", {"content": "x", "parse_special": False}, "parse_special"),
    ("/tokenize", {"messages": [{"role": "function", "content": "42"}]}, "messages[0]"),
    ("/tokenize", {"content": "x", "model": "other"}, "model"),
    ("/apply-template", {"messages": []}, "messages"),
    ("/apply-template", {"messages": [*MESSAGES, {"role": "function", "content": "42"}]}, "messages[2]"),
    ("/apply-template", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
    ("/tokenize", {"content": "x", "tools": []}, "tools"),
    ("/apply-template", b"[not json", None),
])
def test_bad_ids_and_bodies_are_400s_naming_the_field(server, path, body, param):
    response = _post(server, path, body)
    error = _error(response, 404 if param == "model" else 400)
    assert error["param"] == param
    if param is not None:
        assert param.split("[")[0] in error["message"]


def test_the_token_routes_need_the_key(server):
    for path, body in (("/tokenize", {"content": "x"}), ("/detokenize", {"tokens": [5]}),
                       ("/apply-template", {"messages": MESSAGES})):
        assert _error(_post(server, path, body, headers={}), 401)["code"] == "invalid_api_key"


def test_unknown_routes_and_methods_are_json_404s_and_405s(server, client):
    for path in ("/v1/embeddings", "/v1/responses", "/v1/audio/speech", "/nothing/here"):
        error = _error(_post(server, path, {"input": "x"}), 404)
        assert path in error["message"] and error["code"] == "not_found"
    wrong = httpx.get(f"{server.url}/chat/completions", headers=AUTH, timeout=TIMEOUT)
    error = _error(wrong, 405)
    assert "POST" in wrong.headers["allow"] and "POST" in error["message"]
    assert error["code"] == "method_not_allowed"
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model="kvcache-test", input="hello")
    assert raised.value.code == "not_found" and "/v1/embeddings" in raised.value.message


@pytest.mark.parametrize(("route", "fields", "param"), [
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("completion", {"suffix": " and so on"}, "suffix"),
    ("completion", {"echo": True}, "echo"),
])
def test_a_refused_field_is_a_400_the_openai_client_raises_by_name(client, route, fields, param):
    with pytest.raises(openai.BadRequestError) as raised:
        if route == "chat":
            client.chat.completions.create(model="kvcache-test", messages=MESSAGES, max_tokens=2, **fields)
        else:
            client.completions.create(model="kvcache-test", prompt="Once", max_tokens=2, **fields)
    assert raised.value.param == param and "not supported by this server (yet)" in raised.value.message


def test_accepted_and_ignored_fields_answer_as_without_them(client):
    request = dict(model="kvcache-test", messages=MESSAGES, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(**request).choices[0].message.content
    tagged = client.chat.completions.create(**request, user="u-7", metadata={"run": "a"}, store=False,
                                            service_tier="auto", parallel_tool_calls=False,
                                            response_format={"type": "text"}, tool_choice="none", n=1,
                                            extra_body={"cache_prompt": True})
    assert tagged.choices[0].message.content == plain


class FailingTokenizer:
    """The real tokenizer, except that decoding FAIL_IDS raises (as a bug inside a route would)."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer

    def decode(self, ids, *args, **kwargs):
        if list(ids) == FAIL_IDS:
            raise RuntimeError("a bug")
        return self._tokenizer.decode(ids, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def test_models_carry_the_servers_context_and_the_token_routes_its_limits(model, tokenizer):
    settings = ServerSettings(model_name="m", context=64, max_waiting=2, max_body_bytes=4096)
    running = start_server(model, FailingTokenizer(tokenizer), settings, max_running=1, token_budget=64)
    try:
        listed = httpx.get(f"{running.url}/models", timeout=TIMEOUT).json()["data"][0]
        assert listed["max_model_len"] == 64  # vLLM's: the server's context
        assert listed["meta"]["n_ctx_train"] == model.config.max_position_embeddings  # llama-server's
        assert _post(running, "/tokenize", {"content": "hi"}, headers={}).json()["max_model_len"] == 64
        big = _post(running, "/tokenize", {"content": "word " * 2000}, headers={})
        assert "--max-body-bytes" in _error(big, 400)["message"]
        many = {"messages": [{"role": "user", "content": ""}] * 64}  # the context less one: 63
        assert _error(_post(running, "/apply-template", many, headers={}), 400)["param"] == "messages"
        failed = _error(_post(running, "/detokenize", {"tokens": FAIL_IDS}, headers={}), 500)
        assert failed["type"] == "server_error" and "RuntimeError" in failed["message"]
        held = [running.engine.submit([1, 2, 3], max_tokens=50, ignore_eos=True) for _ in range(3)]
        full = _post(running, "/tokenize", {"content": "hi"}, headers={})
        assert _error(full, 429)["code"] == "rate_limit_exceeded"
        for handle in held:
            handle.cancel()
        assert wait_for(lambda: running.engine.queue_depth == 0)
        assert _post(running, "/tokenize", {"content": "hi"}, headers={}).status_code == 200
    finally:
        running.stop()
