"""The prefix-miss explainer's attribution accuracy and cost, through a real server on loopback
(uvicorn on a thread, as the server tests start it). Agent transcripts are replayed turn by turn:
a system prompt with a timestamp, tools, a task, then per turn the agent's reasoning and tool call
and the tool's result, so the history grows. Every later turn sends the turn as it is (a control,
which must be a `hit`) and then once more with ONE injected perturbation of a known cause:

    reasoning_dropped   the last assistant turn sent back without its <think> block
    empty_think         the last assistant turn's reasoning rendered as an empty <think> block
    timestamp           the system prompt's time moved on
    tools_reordered     the same tools, in another order
    whitespace          the last tool result's double space sent as one
    cache_salt          the control again under another cache_salt

The server's replies are the transcript's: each chat request's reply is held by a grammar to the
text the model writes for the agent's next step (the template's render of that assistant message),
so the history a later turn sends holds the server's own earlier reply, as an agent's does, and the
explainer compares it with what the server holds after that reply (cut at max_tokens, as a reply is).

Besides: each session's first turn (never seen), two completions shorter than a block, and, after
filler prompts that oversubscribe the KV pool, each session's last turn again (evicted from the
memory tier: the server runs no lower tier). Each answer's `usage.kvcache_prefix.cause` is
compared with the injected one; the explainer's own time (RequestExplainer.explain, timed by
wrapping it) is set against the request's time to first token (streamed, measured by the client).
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
import threading
import time

import httpx
import uvicorn

from kvcache.engine import Engine
from kvcache.generation.structured import StructuredOutput
from kvcache.server import ServerSettings, bind, build_app

EXPECTED = {"first_turn": "never_seen", "control": "hit", "reasoning_dropped": "reasoning_rerendered",
            "empty_think": "reasoning_rerendered", "timestamp": "volatile_system_field",
            "tools_reordered": "tools_reordered", "whitespace": "normalisation", "cache_salt": "cache_salt",
            "short": "shorter_than_block", "evicted": "evicted"}
PERTURBATIONS = ("reasoning_dropped", "timestamp", "tools_reordered", "whitespace", "cache_salt",
                 "empty_think")
AGENTS = ("Ada", "Basil", "Cora", "Dmitri", "Elke", "Farid", "Greta", "Hugo")
FILES = ("src/totals.py", "src/parse.py", "tests/test_totals.py", "src/report.py")
TOOLS = [{"type": "function", "function": {
    "name": name, "description": about,
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
    for name, about in (("read_file", "Read a file"), ("run_tests", "Run the tests of a file"),
                        ("search", "Search the code"))]
MODEL_NAME = "bench"


class Served:
    """A server on a free loopback port for `engine`; explain_s: the explainer's time per request
    before it is submitted; reply_s, warm_s: its times after the reply (remembering it; a chat's
    history rendered for the next turn, on a preparing thread)."""

    def __init__(self, engine: Engine, tokenizer) -> None:
        app = build_app(engine, tokenizer, ServerSettings(model_name=MODEL_NAME, max_body_bytes=1 << 20))
        self.tokenizer = tokenizer
        self.explain_s: list[float] = []
        self.reply_s: list[float] = []
        self.warm_s: list[float] = []
        why = app.state.server.why
        why.explain, why.reply = timed(why.explain, self.explain_s), timed(why.reply, self.reply_s)
        why.warm = timed(why.warm, self.warm_s)
        self.forced: str | None = None  # the text the next chat reply is held to (None: the model's own)
        submit = engine.submit

        def forced(prompt, params, **options):
            if self.forced is None:
                return submit(prompt, params, **options)
            grammar = StructuredOutput("grammar", f"start: {json.dumps(self.forced)}\n", "bench")
            return submit(prompt, dataclasses.replace(params, structured=grammar), **options)

        engine.submit = forced
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the benchmark's server did not start within 60 s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def timed(method, times: list[float]):
    """`method`, each call's time appended to `times`."""

    def wrapped(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            times.append(time.perf_counter() - started)

    return wrapped


def system_prompt(session: int, minute: int) -> str:
    return (f"You are {AGENTS[session % len(AGENTS)]}, a coding agent on session {session}. "
            f"Work step by step. Current time: 2026-12-05 14:{minute:02d}:07 UTC.")


def assistant(session: int, step: int, reasoning: str | None, tools: bool) -> dict:
    """The agent's step `step`: reasoning (kept, dropped: None, or 'empty') and one tool call (as
    tool_calls, or written in the text where the template renders no tools)."""
    path = FILES[(session + step) % len(FILES)]
    tool = TOOLS[step % len(TOOLS)]["function"]["name"]
    think = {"kept": f"<think>Step {step}: {tool} on {path} before changing anything.</think>",
             "empty": "<think>\n\n</think>\n\n", None: ""}[reasoning]
    arguments = json.dumps({"path": path})
    if not tools:
        return {"role": "assistant", "content": f"{think}Calling {tool}({arguments})."}
    call = {"id": f"call-{session}-{step}", "type": "function",
            "function": {"name": tool, "arguments": arguments}}
    return {"role": "assistant", "content": think, "tool_calls": [call]}


def tool_result(session: int, step: int, strip: bool, tools: bool) -> dict:
    path = FILES[(session + step) % len(FILES)]
    text = f"{path}:{3 + step}: total = sum(rows)  # {session * 10 + step} rows\nok\n"
    text = text.replace("  #", " #") if strip else text
    if not tools:
        return {"role": "user", "content": f"Tool result:\n{text}"}
    return {"role": "tool", "tool_call_id": f"call-{session}-{step}", "content": text}


def reply_text(tokenizer, body: dict, message: dict) -> str | None:
    """The text the model writes as `message` in answer to `body`'s chat: the template's render of the
    history with it, after the render with the generation prompt, up to the end-of-turn marker (what
    follows a one-letter reply's text); None where the template renders the two otherwise."""
    variables = {"tools": body["tools"]} if "tools" in body else {}
    messages = body["messages"]

    def render(history: list, prompt: bool) -> str:
        return tokenizer.apply_chat_template(history, add_generation_prompt=prompt, tokenize=False,
                                             **variables)

    head, whole = render(messages, True), render(messages + [message], False)
    probe = render(messages + [{"role": "assistant", "content": "Q"}], False)
    marker = probe[len(head) + 1:] if probe.startswith(head + "Q") else ""
    if not whole.startswith(head) or not marker or not whole.endswith(marker):
        return None
    return whole[len(head): len(whole) - len(marker)]


def turn_request(session: int, turn: int, perturbation: str | None = None, tools: bool = True) -> dict:
    """The chat request of `session`'s turn `turn` (its history so far), with one perturbation;
    tools: whether the chat template renders tools (offered, called and answered as such)."""
    minute = 7 + (1 if perturbation == "timestamp" else 0)
    messages = [{"role": "system", "content": system_prompt(session, minute)},
                {"role": "user", "content": f"The test of {FILES[session % len(FILES)]} fails. Fix it."}]
    for step in range(turn):
        last = step == turn - 1
        reasoning = "kept" if not last else {"reasoning_dropped": None, "empty_think": "empty"}.get(
            perturbation, "kept")
        messages += [assistant(session, step, reasoning, tools),
                     tool_result(session, step, last and perturbation == "whitespace", tools)]
    body = {"model": MODEL_NAME, "messages": messages}
    if tools:
        offered = TOOLS[1:] + TOOLS[:1] if perturbation == "tools_reordered" else TOOLS
        body.update(tools=offered, tool_choice="none")
    if perturbation == "cache_salt":
        body["cache_salt"] = "another-tenant"
    return body


def send(client: httpx.Client, served: Served, route: str, body: dict, max_tokens: int) -> dict:
    """One streamed request: its usage (with kvcache_prefix), time to first token, explainer time."""
    body = {**body, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    before, replied, warmed = len(served.explain_s), len(served.reply_s), len(served.warm_s)
    started, first, usage = time.perf_counter(), None, None
    with client.stream("POST", f"{served.url}/{route}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{route} answered {response.status_code}: {response.read()[:300]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            choice = (chunk.get("choices") or [{}])[0]
            text = (choice.get("delta") or {}).get("content") or choice.get("text")
            if first is None and text:
                first = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    explained = served.explain_s[before:]
    deadline = time.monotonic() + 30  # (the reply is remembered as the server's stream ends)
    while time.monotonic() < deadline and (len(served.reply_s) == replied or (
            route == "chat/completions" and len(served.warm_s) == warmed)):
        time.sleep(0.001)
    after = served.reply_s[replied:][-1:] + served.warm_s[warmed:][-1:]
    return {"usage": usage, "ttft_s": first, "explain_s": explained[-1] if explained else None,
            "reply_s": sum(after) if after else None}


def record(rows: list, kind: str, answer: dict, **where) -> None:
    prefix = answer["usage"]["kvcache_prefix"]
    expected = EXPECTED[kind]
    right = prefix["cause"] == expected and (expected != "evicted" or prefix["tier"] == "memory")
    rows.append({**where, "injected": kind, "expected": expected, "cause": prefix["cause"],
                 "correct": right, "segment": prefix["segment"], "tier": prefix["tier"],
                 "matched_tokens": prefix["matched_tokens"],
                 "cached_tokens": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
                 "prompt_tokens": answer["usage"]["prompt_tokens"],
                 "ttft_s": answer["ttft_s"], "explain_s": answer["explain_s"], "reply_s": answer["reply_s"]})


def replay(client, served, shape: dict, rows: list) -> None:
    """Every session's turns, interleaved; each later turn a control, then one perturbation (in
    turn, over the kinds the template allows: tools_reordered needs one that renders tools)."""
    tools, max_tokens = shape["tools"], shape["max_tokens"]
    kinds = [kind for kind in PERTURBATIONS if tools or kind != "tools_reordered"]
    slot = 0
    for turn in range(shape["turns"]):
        for session in range(shape["sessions"]):
            def ask(kind: str, perturbation: str | None = None, session: int = session,
                    turn: int = turn) -> None:
                body = turn_request(session, turn, perturbation, tools)
                served.forced = reply_text(served.tokenizer, body, assistant(session, turn, "kept", tools))
                answer = send(client, served, "chat/completions", body, max_tokens)
                served.forced = None
                record(rows, kind, answer, session=session, turn=turn)

            if turn == 0:
                ask("first_turn")
                continue
            ask("control")
            kind = kinds[slot % len(kinds)]
            slot += 1
            ask(kind, kind)


def renders_tools(tokenizer) -> bool:
    """Whether the chat template writes the tools offered into the prompt."""
    messages = [{"role": "user", "content": "hello"}]
    try:
        offered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=TOOLS)
    except Exception:  # noqa: BLE001 (a template that refuses tools renders none)
        return False
    return offered != tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def pressure(client, served, tokens: int, vocab: int) -> None:
    """Unrelated prompts of `tokens` tokens in all (random ids), one token each: the pool's LRU
    reuses every block it held before."""
    generator = random.Random(7)
    while tokens > 0:
        length = min(tokens, 512)
        prompt = [generator.randrange(100, min(vocab, 30000)) for _ in range(length)]
        send(client, served, "completions", {"model": MODEL_NAME, "prompt": prompt}, 1)
        tokens -= length


def confusion(rows: list) -> dict:
    table: dict[str, dict[str, int]] = {}
    for row in rows:
        found = table.setdefault(row["injected"], {})
        found[row["cause"]] = found.get(row["cause"], 0) + 1
    return table


def run(engine: Engine, tokenizer, sessions: int, turns: int, max_tokens: int) -> dict:
    """The replay on a server for `engine`; accuracy, the confusion table and the explainer's cost."""
    shape = {"sessions": sessions, "turns": turns, "max_tokens": max_tokens,
             "tools": renders_tools(tokenizer)}
    served, rows = Served(engine, tokenizer), []
    try:
        with httpx.Client(timeout=600) as client:
            replay(client, served, shape, rows)
            for text in ("Hi", "ok"):
                short = {"model": MODEL_NAME, "prompt": text}
                record(rows, "short", send(client, served, "completions", short, max_tokens))
            pool = engine.pool_tokens
            pressure(client, served, pool + pool // 4, engine.model.config.vocab_size)
            for session in range(sessions):
                answer = send(client, served, "chat/completions",
                              turn_request(session, turns - 1, None, shape["tools"]), max_tokens)
                record(rows, "evicted", answer, session=session, turn=turns - 1)
    finally:
        served.stop()
    return summary(rows, shape)


def summary(rows: list, shape: dict) -> dict:
    """Accuracy, confusion, and the explainer's cost: its time before the request is submitted
    over the time to first token, and with its time after the reply added (off that path)."""
    costs = [row["explain_s"] / row["ttft_s"] for row in rows
             if row["ttft_s"] and row["explain_s"] is not None]
    with_reply = [(row["explain_s"] + (row["reply_s"] or 0.0)) / row["ttft_s"] for row in rows
                  if row["ttft_s"] and row["explain_s"] is not None]
    return {
        "attribution_accuracy": round(sum(row["correct"] for row in rows) / len(rows), 4),
        "attribution_requests": len(rows),
        "attribution_shape": shape,
        "attribution_confusion": confusion(rows),
        "explainer_cost_over_ttft": round(statistics.median(costs), 5),
        "explainer_cost_over_ttft_max": round(max(costs), 5),
        "explainer_cost_with_reply_over_ttft": round(statistics.median(with_reply), 5),
        "explain_s_median": round(statistics.median(row["explain_s"] for row in rows), 6),
        "reply_s_median": round(statistics.median(row["reply_s"] or 0.0 for row in rows), 6),
        "ttft_s_median": round(statistics.median(row["ttft_s"] for row in rows if row["ttft_s"]), 4),
        "attribution_rows": rows,
    }
