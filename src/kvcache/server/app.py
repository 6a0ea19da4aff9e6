"""The OpenAI-compatible HTTP app (Starlette) over one Engine running on its background thread.

    app = build_app(engine, tokenizer, ServerSettings(model_name="kvcache-default"))

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models (the server's context as
max_model_len), llama-server's POST /tokenize, /detokenize and /apply-template, GET /health,
GET /metrics, llama-server's POST /slots/{id}?action=save|restore|erase (a conversation's KV kept by
name on the disk tier: kvcache.server.slots). Every error is OpenAI's JSON shape, an unknown
route's (404) or method's (405) too.
With an API key, every route but /health needs `Authorization: Bearer KEY` (compared in constant
time). With per-tenant keys (`ServerSettings.api_keys`), each request's cache salt derives from
its key's tenant (tenants share no cached blocks) and /metrics, which counts every tenant's
traffic, answers admin keys only (403 for the others). A body over the size limit, a bad field,
a field kvcache does not implement (kvcache.server.fields), a prompt too long: 400. A full
waiting queue: 429 with Retry-After. A client that goes away mid-answer cancels its request (its
blocks are freed at the engine's next step). A request's preparation (JSON, chat template,
tokenizing; the token routes' whole work) runs on a few preparing threads, never on the event
loop: one client's 30,000-message body does not pause the others' streams. Requests waiting for
those threads or on them count toward max_waiting (429 past it), and more messages than a prompt
may hold tokens (MAX_MESSAGES at most) are a 400 before any template renders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvcache.engine import Completion, RequestError
from kvcache.engine.prompts import prompt_ids
from kvcache.engine.sessions import read_kv_hints
from kvcache.generation.params import SamplingParams
from kvcache.reuse.explain import Explanation
from kvcache.server.access_log import log_request, peer_of
from kvcache.server.canonical_history import CanonicalHistory
from kvcache.server.choices import END, Choices, ChoiceStream, read_reply
from kvcache.server.fields import refused_field
from kvcache.server.metrics import ServerMetrics
from kvcache.server.openai_api import (
    MAX_MESSAGES,
    ApiError,
    Call,
    Limits,
    check_prompt_length,
    choice_object,
    chunk_object,
    logprobs_object,
    new_id,
    read_call,
    response_object,
    usage_object,
)
from kvcache.server.own_replies import REASONING_FIELDS, OwnReplies
from kvcache.server.reasoning import opens_in_reasoning, reasoning_format
from kvcache.server.slots import Slots, check_empty, disk_tier, read_action, read_slot_id
from kvcache.server.tenants import ApiKeys, Tenant
from kvcache.server.token_api import read_apply_template, read_detokenize, read_tokenize
from kvcache.server.tools import ToolFieldError, tool_call_objects
from kvcache.server.why import RequestExplainer
from kvcache.text.tool_calls import FAMILIES, tool_format
from kvcache.tiers.saved_prompts import SavedPromptError

PREPARING_THREADS = 2  # requests whose body, chat template and tokens are prepared at once
ROUTES_SAID = ("POST /v1/chat/completions, POST /v1/completions, GET /v1/models, POST /tokenize, "
               "POST /detokenize, POST /apply-template, GET /health, GET /metrics, GET /v1/why/{id}, "
               "POST /slots/{id}")


@dataclass
class ServerSettings:
    """model_name: the id clients ask for. api_key: None = no auth. max_body_bytes, max_prompt_tokens,
    max_tokens: per-request limits (0 for the last two: the context). default_max_tokens:
    when a request gives none. max_waiting: requests queued before new ones get 429. context:
    tokens of one request, prompt and new ones (0: the model's context). api_keys: per-tenant
    keys (`kvcache.server.tenants`; api_key, when also given, is among them). require_cache_salt:
    a request with no tenant must send a cache_salt (400 otherwise). context_source: why the
    context is what it is (e.g. what --kv-budget holds), said in the errors that cite it; empty:
    the model's own. restore_reasoning: put a reply's reasoning back into a chat history sent
    without it (`kvcache.server.own_replies`; off by default). canonical_history: render a chat
    message or tool set that differs from one rendered before only in whitespace, letter case or
    the tools' order in its first form (`kvcache.server.canonical_history`; off by default).
    prerender_next_turn: when a chat reply ends, run the next turn's prefix (the history and the
    reply as a client sends it back) as a one-token request in the background (off by default)."""

    model_name: str = "kvcache"
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 0
    max_tokens: int = 0
    default_max_tokens: int = 256
    max_waiting: int = 256
    context: int = 0
    api_keys: ApiKeys | None = None
    require_cache_salt: bool = False
    context_source: str = ""
    restore_reasoning: bool = False
    canonical_history: bool = False
    prerender_next_turn: bool = False


def build_app(engine, tokenizer, settings: ServerSettings) -> Starlette:
    """The app; its lifespan starts the engine's background thread and stops it at shutdown
    (requests still running then are cancelled)."""
    server = _Server(engine, tokenizer, settings)

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.cancel_all()
            await asyncio.to_thread(engine.stop, 10.0)
            server.preparing.shutdown(wait=False, cancel_futures=True)

    routes = [
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics_page, methods=["GET"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/apply-template", server.apply_template, methods=["POST"]),
        Route("/v1/why/{rid}", server.why_page, methods=["GET"]),
        Route("/slots/{id_slot}", server.slots, methods=["POST"]),
    ]
    handlers = {HTTPException: server.http_error, Exception: server.internal_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.server = server
    return app


class _Server:
    def __init__(self, engine, tokenizer, settings: ServerSettings) -> None:
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        config = engine.model.config
        self.context = settings.context or config.max_position_embeddings
        self.vocab = config.vocab_size
        source = settings.context_source
        of_context = f"the context of {self.context} tokens less one{'; ' + source if source else ''}"
        self.limits = Limits(
            max_prompt_tokens=settings.max_prompt_tokens or self.context - 1,
            max_tokens=settings.max_tokens or self.context - 1,
            default_max_tokens=min(settings.default_max_tokens, settings.max_tokens or self.context - 1),
            max_messages=min(MAX_MESSAGES, settings.max_prompt_tokens or self.context - 1),
            prompt_source="--max-prompt-tokens" if settings.max_prompt_tokens else of_context,
            tokens_source="the server's --max-tokens" if settings.max_tokens else of_context,
            context_source=source,
        )
        self.metrics = ServerMetrics(engine, self.context)
        self.why = RequestExplainer(engine, tokenizer)  # usage.kvcache_prefix: why a prompt missed
        self.own = OwnReplies() if settings.restore_reasoning else None  # replies' reasoning, to put back
        self.canonical = CanonicalHistory() if settings.canonical_history else None  # first forms rendered
        engine.on_finish = self.metrics.finished
        self.preparing = ThreadPoolExecutor(PREPARING_THREADS, thread_name_prefix="kvcache-prepare")
        self._preparing, self._preparing_lock = 0, threading.Lock()  # requests on or for its threads
        self.created = int(time.time())
        store = None if engine.store_tier is None else engine.store_tier.store
        disk = None if store is None else disk_tier(store)
        self.saved = None if disk is None else Slots(engine, disk)  # (its saved conversations pinned)

    # ---- routes --------------------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def models(self, request: Request) -> Response:
        return self._guarded(request) or JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.settings.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "kvcache",
                        "max_model_len": self.context,  # vLLM's: the server's context
                        "meta": {"n_ctx_train": self.engine.model.config.max_position_embeddings,
                                 "n_vocab": self.vocab},  # llama-server's: the model's own
                    }
                ],
            }
        )

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "running": self.engine.running_in_background})

    async def metrics_page(self, request: Request) -> Response:
        try:
            tenant = self._authorize(request)
        except ApiError as error:
            return self._error(error)
        if tenant is not None and not tenant.admin:  # the counters are every tenant's traffic
            return self._error(ApiError(
                403, "/metrics counts every tenant's requests: it needs an admin key (a line 'KEY NAME "
                "admin' in --api-keys FILE, or --api-key)", kind="permission_error", code="admin_key_needed"))
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def why_page(self, request: Request) -> Response:
        """GET /v1/why/{rid}: a recent response's prefix explanation with the tokens around its
        divergence (`kvcache why`); an admin's, like /metrics, when keys are set."""
        try:
            tenant = self._authorize(request)
        except ApiError as error:
            return self._error(error)
        if tenant is not None and not tenant.admin:
            return self._error(ApiError(403, "/v1/why shows every tenant's prompts: it needs an admin key",
                                        kind="permission_error", code="admin_key_needed"))
        rid = request.path_params["rid"]
        found = self.why.context(rid)
        if found is None:
            return self._error(ApiError(404, f"no recent response has the id {rid!r} (the server keeps the "
                                        "last 256)", param="rid", code="not_found"))
        return JSONResponse(found)

    # ---- llama-server's slots: a conversation's KV saved by name on the disk tier ------------------
    async def slots(self, request: Request) -> Response:
        """POST /slots/{id}?action=save|restore|erase (kvcache.server.slots); an admin's, like
        /metrics, when keys are set (a saved conversation is any tenant's prompt)."""
        started = time.perf_counter()
        try:
            tenant = self._authorize(request)
            if tenant is not None and not tenant.admin:
                raise ApiError(403, "/slots saves and restores prompts by name for every tenant: it needs an "
                               "admin key", kind="permission_error", code="admin_key_needed")
            action = read_action(request.query_params)
            name = read_slot_id(request.path_params["id_slot"])
            if self.saved is None:
                raise ApiError(501, "/slots keeps conversations on the disk tier, and this server has none: "
                               "start it with --kv-disk DIR", param="action", code="kv_disk_needed")
            raw = await self._body(request)
            if action == "save":
                ids, salt = await self._prepared(self._slot_prompt, raw, tenant)
                answer = await self.saved.save(name, ids, salt)
            else:
                check_empty(_json_body(raw) if raw.strip() else None)
                answer = await (self.saved.restore(name) if action == "restore" else self.saved.erase(name))
        except (ApiError, RequestError, SavedPromptError) as error:
            refused = error if isinstance(error, ApiError) else ApiError(
                400 if isinstance(error, RequestError) else 500, str(error))
            log_request(peer_of(request), request.url.path, refused.status, started, note=refused.message)
            return self._error(refused)
        log_request(peer_of(request), request.url.path, 200, started)
        return JSONResponse(answer)

    def _slot_prompt(self, raw: bytes, tenant: Tenant | None) -> tuple[list[int], str | None]:
        """(token ids, cache salt) of a slot save's body: the conversation as the chat route
        (messages) or the completion route (prompt) takes it, salted for its tenant."""
        body = _json_body(raw)
        if not isinstance(body, dict):
            raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
        given = [name for name in ("messages", "prompt") if name in body]
        if len(given) != 1:
            raise ApiError(400, "a save takes the conversation as messages (the chat route's) or prompt (a "
                           f"text or token ids), one of them; got {' and '.join(given) or 'neither'}",
                           param=given[-1] if given else "messages")
        refused = refused_field("slot-save", body)
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0])
        call = self._salted(read_call("chat" if given == ["messages"] else "completion", body, self.limits),
                            tenant)
        self._check_model(call.model)
        ids, _ = self._prompt_ids(call)
        check_prompt_length(len(ids), 1, self.limits, self.context)
        return ids, call.params.cache_salt

    # ---- llama-server's and vLLM's token routes --------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        return await self._answer(request, self._tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer(request, self._detokenize)

    async def apply_template(self, request: Request) -> Response:
        return await self._answer(request, self._apply_template)

    async def _answer(self, request: Request, prepare) -> Response:
        """A token route's answer: prepare(the body's bytes) -> a JSON object, on a preparing thread,
        behind the chat route's key, body limit, queue bound and errors."""
        started = time.perf_counter()
        try:
            self._authorize(request)
            answer = await self._prepared(prepare, await self._body(request))
        except ApiError as error:
            log_request(peer_of(request), request.url.path, error.status, started, note=error.message)
            return self._error(error)
        log_request(peer_of(request), request.url.path, 200, started)
        return JSONResponse(answer)

    def _tokenize(self, raw: bytes) -> dict:
        call = read_tokenize(_json_body(raw), self.limits)
        self._check_model(call.model)
        text = call.text if call.messages is None else self._render(
            call.messages, call.add_generation_prompt, _variables(call.template_kwargs, call.tools))
        ids = self.tokenizer.encode(text, add_special_tokens=call.add_special)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.context}  # (vLLM's count, length)

    def _detokenize(self, raw: bytes) -> dict:
        tokens, model = read_detokenize(_json_body(raw), self.tokenizer.vocab_size)
        self._check_model(model)
        text = self.tokenizer.decode(tokens)
        return {"content": text, "prompt": text}  # llama-server's name, vLLM's

    def _apply_template(self, raw: bytes) -> dict:
        call = read_apply_template(_json_body(raw), self.limits)
        self._check_model(call.model)
        return {"prompt": self._render(call.messages, call.add_generation_prompt,
                                       _variables(call.template_kwargs, call.tools))}

    def _render(self, messages: list[dict], add_generation_prompt: bool, variables: dict) -> str:
        """The chat template's text of `messages` (in jinja2's sandbox) with its further `variables`
        (the tools offered, chat_template_kwargs), as the chat route renders it."""
        if variables.get("tools"):
            self._check_tools_rendered()
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **variables)
        except Exception as error:  # noqa: BLE001 (a chat template that refuses these messages)
            raise ApiError(400, f"the chat template could not render these messages: {error}",
                           param="messages") from None

    # ---- errors outside the routes -------------------------------------------------------------
    async def http_error(self, request: Request, error: HTTPException) -> Response:
        """An unknown route (404) or method (405) in OpenAI's shape, not Starlette's plain text."""
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message, code = f"there is no route {where} on this server (it serves {ROUTES_SAID})", "not_found"
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "another method")
            message, code = f"{where} is not allowed: this route takes {allowed}", "method_not_allowed"
        else:
            message, code = f"{where}: {error.detail}", None
        return self._error(ApiError(error.status_code, message, code=code, headers=error.headers))

    async def internal_error(self, request: Request, error: Exception) -> Response:
        """A failure inside a route (a bug): a 500 in OpenAI's shape; the traceback goes to the log."""
        return self._error(ApiError(500, f"the server failed on {request.method} {request.url.path}: "
                                    f"{type(error).__name__}", kind="server_error"))

    # ---- one completion ------------------------------------------------------------------------
    async def _complete(self, request: Request, kind: str) -> Response:
        started = time.perf_counter()
        try:
            tenant = self._authorize(request)
            raw = await self._body(request)
            call, ids, why = await self._prepared(self._prepare, kind, raw, tenant)
            if self.engine.queue_depth >= self.settings.max_waiting:
                raise _queue_full(self.settings.max_waiting)
            hints = read_kv_hints(call.kv_hints, request.headers.get("x-session-id"))  # (a 400 names it)
            choices = Choices(lambda params, index: self.engine.submit(
                ids, params, **({} if hints is None or index else {"hints": hints})), call.params, call.n)
            rid = new_id(kind)
            self.why.keep(rid, why, ids)
            self.metrics.explained(why.cause)
        except (ApiError, RequestError) as error:
            refused = error if isinstance(error, ApiError) else ApiError(400, str(error))
            log_request(peer_of(request), request.url.path, refused.status, started, note=refused.message)
            return self._error(refused)
        if call.stream:
            logged = _stream_logger(request, started)

            def finished(completion: Completion | None) -> None:
                self._remember(call, ids, choices)
                logged(completion)

            return StreamingResponse(
                self._events(call, choices, finished, rid, why),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        response = await self._whole(request, call, choices, rid, why)
        self._remember(call, ids, choices)
        path, status = request.url.path, response.status_code
        log_request(peer_of(request), path, status, started, completion=choices.handles[0].result())
        return response

    async def _whole(self, request: Request, call: Call, choices: Choices, rid: str,
                     why: Explanation) -> Response:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, choices))
        try:
            async for _ in choices.updates():  # (the engine reads the text: Completion.text)
                pass
        finally:
            watcher.cancel()
            choices.cancel()
        completions = choices.results()
        for completion in completions:
            if completion.finish_reason in ("error", "cancelled"):
                return self._failed(completion)
        answers = [self._choice(call, index, completion) for index, completion in enumerate(completions)]
        return JSONResponse(response_object(call, rid, self.settings.model_name, answers,
                                            _usage(completions, why), _drift(completions[0])))

    def _remember(self, call: Call, ids: list[int], choices: Choices) -> None:
        """Each finished choice's reply told to the explainer (what the server holds after it:
        prompt `ids` and the reply's tokens; the history rendered for the next turn's explanation,
        on a preparing thread) and, with --restore-reasoning, its reasoning kept for the next turn."""
        for handle in choices.handles:
            completion = handle.result() if handle.done else None
            if completion is None or completion.finish_reason in ("error", "cancelled"):
                continue
            self.why.reply(call.prompt, ids, completion.tokens, call.params.cache_salt,
                           call.template_variables())
            if handle is choices.handles[0]:
                self._in_background(self.why.warm, call.prompt, call.template_variables())
            if self.settings.prerender_next_turn and call.kind == "chat" and handle is choices.handles[0]:
                message = self._choice(call, 0, completion)["message"]
                self._in_background(self._prerender, call, message)
            if self.own is None or call.kind != "chat":
                continue
            content = read_reply(call, completion.text or "")[1]
            self.own.remember(call.prompt, call.template_variables(), completion.text or "",
                              bool(call.reasoning), content)

    def _in_background(self, work, *args) -> None:
        """`work(*args)` on a preparing thread; not once the server has shut them down (stopping)."""
        try:
            self.preparing.submit(work, *args)
        except RuntimeError:  # (cannot schedule new futures after shutdown: the server is stopping)
            return

    def _prerender(self, call: Call, message: dict) -> None:
        """--prerender-next-turn (on a preparing thread): the history and `message` (the reply as the
        client was sent it, without its reasoning field) rendered as the next turn's prefix, through
        the repairs a next turn goes through, and run as a one-token request whose handle is left to
        finish, so the prefix's blocks are in the cache when the next turn comes. A prefix the
        engine or the context refuses is not run."""
        sent = {name: value for name, value in message.items() if name not in REASONING_FIELDS}
        history = [*call.prompt, {**sent, "content": sent.get("content") or ""}]
        variables = call.template_variables()
        if self.own is not None:
            history = self.own.restore(history, variables)
        if self.canonical is not None:
            history = self.canonical.messages(history)
        params = SamplingParams(max_tokens=1, temperature=0.0, cache_salt=call.params.cache_salt)
        try:
            text = self._render(history, False, variables)  # (as _prompt_ids renders a prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            check_prompt_length(len(ids), 1, self.limits, self.context)
            self.engine.submit(ids, params)
        except (ApiError, RequestError):
            return

    def _choice(self, call: Call, index: int, completion: Completion) -> dict:
        """Choice `index` of a whole answer: its reasoning, content and tool calls read from its text."""
        reasoning, text, calls = read_reply(call, completion.text or "")
        finish = "tool_calls" if calls else completion.finish_reason
        return choice_object(call, index, text, finish, self._logprobs(call, completion.logprobs),
                             tool_call_objects(calls), reasoning)

    async def _events(self, call: Call, choices: Choices, finished, rid: str, why: Explanation):
        """The stream's events, each choice's carrying its index; finished(the first choice's
        completion, or None) when it ends (None: the client left before the engine finished)."""
        updates = choices.updates()
        try:
            streams = [ChoiceStream(call) for _ in range(call.n)]
            if call.kind == "chat":
                for index in range(call.n):
                    yield _sse(chunk_object(call, rid, self.settings.model_name, None, None, index=index,
                                            first=True))
            async for index, token, piece in updates:  # the engine's reading of each reply, stops cut
                if token is END:
                    completion = choices.handles[index].result()
                    if completion.finish_reason in ("error", "cancelled"):
                        yield _sse(_failure(completion).body())
                        break
                    for chunk in self._ended(call, rid, streams[index], choices.handles[index], index):
                        yield _sse(chunk)
                    continue
                streams[index].tokens += token is not None
                for chunk in self._pieces(call, rid, streams[index], choices.handles[index], index, piece):
                    yield _sse(chunk)
            else:
                if call.include_usage:
                    completions = choices.results()
                    yield _sse(chunk_object(call, rid, self.settings.model_name, None, None,
                                            usage=_usage(completions, why), kv_drift=_drift(completions[0])))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the response task is cancelled) or the stream ended
            await updates.aclose()
            choices.cancel()
            first = choices.handles[0]
            finished(first.result() if first.done else None)

    def _pieces(self, call: Call, rid: str, stream: ChoiceStream, handle, index: int,
                piece: str) -> list[dict]:
        """The chunks of one update's text: its reasoning, then its content (what may go out now),
        the logprobs of the tokens made since the last chunk on the first of them."""
        reasoning, content = stream.feed(piece)
        chunks = []
        for text, is_reasoning in ((reasoning, True), (content, False)):
            if text:
                logprobs = self._streamed_logprobs(call, stream, handle)
                stream.offset += 0 if is_reasoning else len(text)
                said, reasoned = (None, text) if is_reasoning else (text, None)
                chunks.append(chunk_object(call, rid, self.settings.model_name, said, None, index=index,
                                           logprobs=logprobs, reasoning=reasoned))
        return chunks

    def _ended(self, call: Call, rid: str, stream: ChoiceStream, handle, index: int) -> list[dict]:
        """The chunks that end choice `index` (its handle done): what was held (reasoning, content,
        the tool calls), then its finish reason."""
        model, finish = self.settings.model_name, handle.result().finish_reason
        rest = self._streamed_logprobs(call, stream, handle) if stream.sent < stream.tokens else None
        reasoning, held, found = stream.finish()
        chunks = []
        if reasoning:
            chunks.append(chunk_object(call, rid, model, None, None, index=index, logprobs=rest,
                                       reasoning=reasoning))
            rest = None
        if held or found:
            chunks.append(chunk_object(call, rid, model, held, None, index=index, logprobs=rest,
                                       tool_calls=tool_call_objects(found, streamed=True)))
            rest, finish = None, "tool_calls" if found else finish
        chunks.append(chunk_object(call, rid, model, None, finish, index=index, logprobs=rest))
        return chunks

    def _logprobs(self, call: Call, entries: list | None, offset: int = 0) -> dict | None:
        """The logprobs object of `entries` (TokenLogprobs), when the call asked for logprobs."""
        if call.params.logprobs is None or entries is None:
            return None
        return logprobs_object(call.kind, entries, lambda token: self.tokenizer.decode([token]), offset)

    def _streamed_logprobs(self, call: Call, stream: ChoiceStream, handle) -> dict | None:
        """The logprobs object of a choice's tokens made since the last that went out (then counted
        as out), when the call asked for logprobs."""
        start, stream.sent = stream.sent, stream.tokens
        if call.params.logprobs is None:
            return None
        return self._logprobs(call, handle.logprobs[start:stream.tokens], stream.offset)

    async def _prepared(self, prepare, *args):
        """`prepare(*args)` on a preparing thread: parsing, the chat template and tokenizing are the
        request's own work, off the event loop, so they never hold up other clients' streams.
        While it waits for a thread or runs on one it counts toward max_waiting, beside the
        engine's queue: ApiError(429) when they are full."""
        if self._preparing + self.engine.queue_depth >= self.settings.max_waiting:
            raise _queue_full(self.settings.max_waiting)
        with self._preparing_lock:
            self._preparing += 1
        future = self.preparing.submit(prepare, *args)
        future.add_done_callback(self._prepare_done)  # (run, failed, or cancelled before it ran)
        return await asyncio.wrap_future(future)

    def _prepare_done(self, future) -> None:
        with self._preparing_lock:
            self._preparing -= 1

    # ---- checks --------------------------------------------------------------------------------
    def _prepare(self, kind: str, raw: bytes,
                 tenant: Tenant | None = None) -> tuple[Call, list[int], Explanation]:
        """The request read from its body, salted for its tenant, its prompt's token ids and why they
        do or do not match an earlier prompt (on a preparing thread). A chat reply is split into
        reasoning and content when the chat template writes reasoning markers and no grammar holds
        the reply from its first token."""
        call = self._salted(read_call(kind, _json_body(raw), self.limits), tenant)
        self._check_model(call.model)
        if self.own is not None and call.kind == "chat":
            call = dataclasses.replace(call, prompt=self.own.restore(call.prompt, call.template_variables()))
        if self.canonical is not None and call.kind == "chat":
            call = self._canonical(call)
        ids, text = self._prompt_ids(call)
        check_prompt_length(len(ids), call.params.max_tokens, self.limits, self.context)
        if call.tools is not None and tool_format(self._template()) is not None:
            call = self._in_tool_family(call)
        if text is not None and call.params.structured is None and reasoning_format(self._template()):
            call = dataclasses.replace(call, reasoning=opens_in_reasoning(text))
        why = self.why.explain(call.prompt, ids, call.params.cache_salt, call.template_variables())
        return call, ids, why

    def _canonical(self, call: Call) -> Call:
        """`call` with its messages and tools in the forms first rendered (--canonical-history)."""
        tools = call.tools
        if tools is not None:
            tools = dataclasses.replace(tools, tools=self.canonical.tools(tools.tools))
        return dataclasses.replace(call, prompt=self.canonical.messages(call.prompt), tools=tools)

    def _in_tool_family(self, call: Call) -> Call:
        """`call` with its tools read and forced in the family the chat template writes calls in."""
        tools = dataclasses.replace(call.tools, family=tool_format(self._template()))
        if tools == call.tools:  # (read_call held a forced reply to the default family's calls)
            return call
        try:
            forced = tools.grammar()
        except ToolFieldError as error:
            raise ApiError(400, str(error), param=error.param) from None
        params = call.params if forced is None else dataclasses.replace(call.params, structured=forced)
        return dataclasses.replace(call, tools=tools, params=params)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.settings.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.settings.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def _prompt_ids(self, call: Call) -> tuple[list[int], str | None]:
        """The prompt's token ids and, for chat messages, the chat template's text they are (with the
        tools offered and chat_template_kwargs); ApiError(400) naming tools when the template writes
        tool calls in no format kvcache reads."""
        if call.kind != "chat" or self.tokenizer is None:
            return prompt_ids(call.prompt, self.tokenizer, self.vocab), None
        if call.tools is not None:
            self._check_tools_rendered()
        text = self._render(call.prompt, True, call.template_variables())
        ids = self.tokenizer.encode(text, add_special_tokens=False)  # (the template writes special tokens)
        return prompt_ids(ids, self.tokenizer, self.vocab), text

    def _template(self) -> str | None:
        """The chat template's source (None: the tokenizer has none)."""
        return getattr(self.tokenizer, "chat_template", None)

    def _check_tools_rendered(self) -> None:
        """ApiError(400) naming tools when the chat template renders none, or writes tool calls in no
        family kvcache reads back."""
        if tool_format(self._template()) is None:
            families = ", ".join(FAMILIES)
            raise ApiError(400, "tools: this model's chat template renders no tools, or writes tool calls in "
                           f"a format kvcache cannot read back (it reads the {families} families: "
                           "<tool_call>{json}</tool_call> as Qwen2.5's template writes, [TOOL_CALLS] [...] "
                           "as Mistral's, a {\"name\", \"parameters\"} reply as Llama-3.1's); serve a model "
                           "whose template does (or kvcache serve --chat-template FILE), or send no tools",
                           param="tools")

    def _salted(self, call: Call, tenant: Tenant | None) -> Call:
        """`call` with its tenant's cache salt (its own salt combined in); ApiError(400) for a
        request with no tenant and no salt under --require-cache-salt."""
        if tenant is not None:
            return dataclasses.replace(
                call, params=dataclasses.replace(call.params, cache_salt=tenant.salt(call.params.cache_salt)))
        if self.settings.require_cache_salt and call.params.cache_salt is None:
            raise ApiError(400, "this server requires a cache_salt on every request (--require-cache-salt): "
                           "send one of your own, e.g. your user's id", param="cache_salt")
        return call

    def _authorize(self, request: Request) -> Tenant | None:
        """The tenant of the request's key (None: no tenants); ApiError(401) without a valid key."""
        keys, key = self.settings.api_keys, self.settings.api_key
        if keys is None and key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        tenant = None if keys is None or scheme.lower() != "bearer" else keys.tenant_of(token.strip())
        if keys is None:
            valid = scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())
        else:
            valid = tenant is not None
        if not valid:
            raise ApiError(
                401,
                "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                code="invalid_api_key",
            )
        return tenant

    def _guarded(self, request: Request) -> Response | None:
        try:
            self._authorize(request)
        except ApiError as error:
            return self._error(error)
        return None

    async def _body(self, request: Request) -> bytes:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ApiError(
                400,
                f"the request body is {declared} bytes, more than this server's limit of "
                f"{limit} (--max-body-bytes)",
            )
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(
                    400,
                    f"the request body is more than this server's limit of {limit} bytes (--max-body-bytes)",
                )
            chunks.append(chunk)
        return b"".join(chunks)

    def _error(self, error: ApiError) -> Response:
        self.metrics.rejected(error.status)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    def _failed(self, completion: Completion) -> Response:
        error = _failure(completion)
        return JSONResponse(error.body(), status_code=error.status)


def _json_body(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body's JSON is nested too deeply") from None


def _queue_full(max_waiting: int) -> ApiError:
    return ApiError(429, f"the server's queue is full ({max_waiting} requests waiting or being "
                    "prepared); retry shortly", kind="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": "1"})


def _failure(completion: Completion) -> ApiError:
    if completion.finish_reason == "cancelled":
        return ApiError(503, "the request was cancelled (the server is shutting down)", kind="server_error")
    return ApiError(500, f"the request failed inside the engine: {completion.error}", kind="server_error")


def _stream_logger(request: Request, started: float):
    """What a stream calls when it ends: its access-log line."""

    def finished(completion: Completion | None) -> None:
        note = "" if completion is not None else "the client went away"
        log_request(peer_of(request), request.url.path, 200, started, stream=True, completion=completion,
                    note=note)

    return finished


def _variables(template_kwargs: dict | None, tools: list | None) -> dict:
    """The chat template's further variables: chat_template_kwargs and the tools offered."""
    return {**(template_kwargs or {}), **({"tools": tools} if tools else {})}


def _usage(completions: list[Completion], why: Explanation) -> dict:
    """The usage object of a request's choices (the prompt counted once, as its first choice found it
    cached; each choice's tokens), with `kvcache_prefix`: why the prompt did or did not match
    (docs/why-miss.md); with several choices, `kvcache_cached_tokens_by_choice`: the prompt tokens
    each found cached (the later ones, the first's blocks); where drafts ran (speculative decoding),
    `kvcache_speculation`: the draft tokens verified and accepted, over its choices."""
    first = completions[0].usage
    made = sum(len(completion.tokens) for completion in completions)
    usage = {**usage_object(first.prompt_tokens, first.cached_tokens, made), "kvcache_prefix": why.as_dict()}
    if len(completions) > 1:
        usage["kvcache_cached_tokens_by_choice"] = [done.usage.cached_tokens for done in completions]
    drafted = sum(done.usage.drafted_tokens for done in completions)
    if drafted:
        accepted = sum(done.usage.accepted_tokens for done in completions)
        usage["kvcache_speculation"] = {"drafted_tokens": drafted, "accepted_tokens": accepted}
    return usage


def _drift(completion: Completion) -> dict | None:
    """The request's `kv_drift` object (the drift probe's: positions, mean_kl, max_kl,
    top1_agreement), or None when it was not probed."""
    return None if completion.kv_drift is None else completion.kv_drift.as_dict()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _cancel_on_disconnect(request: Request, handle) -> None:
    """Cancel `handle` (a request's, or its Choices) when the client disconnects (its body already
    read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return
