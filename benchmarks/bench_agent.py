"""An agent loop and schema-constrained answers on a real model through `kvcache serve` and the
official `openai` client: what a user's agent sends, with every exchange written down.

    .venv/bin/python benchmarks/bench_agent.py [-m qwen2.5-coder-0.5b] [--threads 2] [--chat-template FILE]
        [--out FILE]

Starts `kvcache serve -m MODEL` on 127.0.0.1 and, greedy (temperature 0):
- agent loops: a question with tools offered (tool_choice "auto", then "required"); the call the
  model makes is parsed from tool_calls, this script runs the tool (a fixed weather table, exact
  arithmetic) and sends its result as a `tool` message; the model answers. Each later turn's
  usage.prompt_tokens_details.cached_tokens says whether it found the earlier turn's blocks.
  One loop's first turn is streamed, its tool_calls deltas joined.
- json_schema answers (strict): each parsed and validated with jsonschema; a follow-up turn with
  the same schema (the first answer sent back) reports its cached_tokens too.
Writes benchmarks/results/agent_qwen.json (the command, commit, every request and response, and a
summary: calls parsed, schema answers valid, later turns' cached tokens). Exits 1 when a call did
not parse under "required", an answer did not validate, or a later turn found nothing cached.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from bench_common import commit, free_port
from bench_serve_gguf import wait_ready

RESULTS = Path(__file__).parent / "results" / "agent_qwen.json"
MODEL_NAME = "m"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"], "additionalProperties": False}}}
MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "The exact product of two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, MULTIPLY]
WEATHER_TABLE = {"paris": "18 C, light rain", "oslo": "4 C, clear", "tokyo": "22 C, sunny"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Use the tools when they help."}
QUESTIONS = [
    ("auto", "What is the weather in Paris right now?"),
    ("required", "What is 1234 multiplied by 5678?"),
    ("required", "What is the weather in Oslo?"),
]

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "languages": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                       "maxItems": 5}}}
SENTIMENT = {"type": "object", "additionalProperties": False, "required": ["sentiment", "confidence"],
             "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                            "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}
FUNCTION = {"type": "object", "additionalProperties": False, "required": ["name", "parameters", "returns"],
            "properties": {"name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,39}$"},
                           "parameters": {"type": "array", "maxItems": 4, "items": {
                               "type": "object", "additionalProperties": False, "required": ["name", "type"],
                               "properties": {"name": {"type": "string", "maxLength": 30},
                                              "type": {"enum": ["int", "str", "float", "list"]}}}},
                           "returns": {"enum": ["int", "str", "float", "list", "None"]}}}
SCHEMA_TASKS = [
    ("person", PERSON, "Alice is a 34-year-old engineer who writes Python and Rust. Describe her as JSON.",
     "Now Bob, 51, who writes only C."),
    ("sentiment", SENTIMENT, "Classify the sentiment of: 'The build finally passes and it is fast.'",
     "And of: 'The server crashed again overnight.'"),
    ("function_signature", FUNCTION, "Describe a Python function that returns the sum of a list of floats.",
     "Now one that counts the words in a string."),
]


def run_tool(name: str, arguments: dict) -> str:
    """What this script's tools answer (a JSON text), or an error text the model reads back."""
    if name == "get_weather":
        city = str(arguments.get("city", ""))
        found = WEATHER_TABLE.get(city.strip().lower().split(",")[0])
        answer = {"city": city, "weather": found} if found else {"error": f"no weather for {city!r}"}
        return json.dumps(answer)
    if name == "multiply":
        try:
            return json.dumps({"product": int(arguments["a"]) * int(arguments["b"])})
        except (KeyError, TypeError, ValueError) as error:
            return json.dumps({"error": f"multiply needs integers a and b: {error}"})
    return json.dumps({"error": f"no tool named {name!r}"})


def _usage(usage) -> dict:
    return usage.model_dump(exclude_none=True) if usage is not None else {}


def _cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _ask(client, request: dict) -> tuple[dict, object, float]:
    started = time.perf_counter()
    reply = client.chat.completions.create(model=MODEL_NAME, **request)
    return reply.model_dump(exclude_none=True), reply, time.perf_counter() - started


def _streamed(client, request: dict) -> tuple[dict, dict, float]:
    """(a message joined from the stream's deltas, its usage, seconds) of one streamed request."""
    started, content, calls, usage, finish = time.perf_counter(), "", {}, {}, None
    for chunk in client.chat.completions.create(model=MODEL_NAME, stream=True,
                                                stream_options={"include_usage": True}, **request):
        usage = _usage(chunk.usage) or usage
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                                      "function": {"name": "", "arguments": ""}, "deltas": 0})
                call["id"] = delta.id or call["id"]
                call["deltas"] += 1
                if delta.function is not None:
                    call["function"]["name"] += delta.function.name or ""
                    call["function"]["arguments"] += delta.function.arguments or ""
    message = {"role": "assistant", "content": content or None, "finish_reason": finish,
               "tool_calls": [calls[index] for index in sorted(calls)]}
    return message, usage, time.perf_counter() - started


def _parsed_calls(tool_calls: list[dict]) -> list[tuple[str, dict]] | None:
    """[(name, arguments)] of the calls, or None when a call's arguments are not a JSON object or
    its name is not one of the tools'."""
    names = {tool["function"]["name"] for tool in TOOLS}
    parsed = []
    for call in tool_calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except (KeyError, TypeError, json.JSONDecodeError):
            return None
        if call["function"].get("name") not in names or not isinstance(arguments, dict):
            return None
        parsed.append((call["function"]["name"], arguments))
    return parsed


def agent_loop(client, choice: str, question: str, stream_first: bool) -> dict:
    """One loop: question -> tool calls (run here) -> the answer; its exchanges and figures."""
    messages = [SYSTEM, {"role": "user", "content": question}]
    first = {"messages": list(messages), "tools": TOOLS, "tool_choice": choice, "temperature": 0,
             "max_tokens": 200}
    if stream_first:
        message, usage, seconds = _streamed(client, first)
        calls = [{key: call[key] for key in ("id", "type", "function")} for call in message["tool_calls"]]
        response = {"streamed": True, "message": message, "usage": usage}
    else:
        response, reply, seconds = _ask(client, first)
        message = response["choices"][0]["message"]
        calls, usage = message.get("tool_calls") or [], response.get("usage", {})
    turns = [{"request": first, "response": response, "seconds": seconds}]
    parsed = _parsed_calls(calls) if calls else None
    loop = {"tool_choice": choice, "question": question, "turns": turns, "calls": len(calls),
            "calls_parsed": parsed is not None, "answer": None, "later_turn_cached_tokens": None}
    if not parsed:
        loop["answer"] = message.get("content")
        return loop
    messages.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": calls})
    results = []
    for call, (name, arguments) in zip(calls, parsed):
        result = run_tool(name, arguments)
        results.append({"name": name, "arguments": arguments, "result": result})
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    second = {"messages": list(messages), "tools": TOOLS, "tool_choice": "auto", "temperature": 0,
              "max_tokens": 200}
    response, reply, seconds = _ask(client, second)
    turns.append({"request": second, "response": response, "seconds": seconds})
    loop.update(tool_results=results, answer=response["choices"][0]["message"].get("content"),
                later_turn_cached_tokens=_cached(response.get("usage", {})),
                later_turn_prompt_tokens=response.get("usage", {}).get("prompt_tokens"))
    return loop


def schema_task(client, name: str, schema: dict, question: str, follow_up: str) -> dict:
    """A strict json_schema answer, then a follow-up turn under the same schema; each validated."""
    import jsonschema

    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    messages, answers, turns = [{"role": "user", "content": question}], [], []
    for later in (False, True):
        if later:
            messages += [{"role": "assistant", "content": answers[-1]["content"]},
                         {"role": "user", "content": follow_up}]
        request = {"messages": list(messages), "response_format": response_format, "temperature": 0,
                   "max_tokens": 300}
        response, reply, seconds = _ask(client, request)
        content = response["choices"][0]["message"].get("content") or ""
        try:
            jsonschema.validate(json.loads(content), schema)
            error = None
        except (json.JSONDecodeError, jsonschema.ValidationError) as failed:
            error = str(failed).splitlines()[0]
        answers.append({"content": content, "valid": error is None, "error": error,
                        "finish_reason": response["choices"][0].get("finish_reason"),
                        "cached_tokens": _cached(response.get("usage", {}))})
        turns.append({"request": request, "response": response, "seconds": seconds})
    return {"name": name, "schema": schema, "answers": answers, "turns": turns,
            "later_turn_cached_tokens": answers[1]["cached_tokens"]}


def run(args) -> dict:
    import openai

    port = free_port()
    command = [sys.executable, "-m", "kvcache", "serve", "-m", args.model, "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", MODEL_NAME, "--threads", str(args.threads)]
    if args.chat_template:
        command += ["--chat-template", args.chat_template]
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        print(f"waiting for kvcache serve -m {args.model}…", file=sys.stderr, flush=True)
        wait_ready(url, process)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=600, max_retries=0)
        loops = [agent_loop(client, choice, question, stream_first=index == len(QUESTIONS) - 1)
                 for index, (choice, question) in enumerate(QUESTIONS)]
        schemas = [schema_task(client, *task) for task in SCHEMA_TASKS]
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    required = [loop for loop in loops if loop["tool_choice"] == "required"]
    answers = [answer for task in schemas for answer in task["answers"]]
    later = [row["later_turn_cached_tokens"] for row in [*loops, *schemas]
             if row["later_turn_cached_tokens"] is not None]
    summary = {
        "tool_calls_parsed": f"{sum(loop['calls_parsed'] for loop in loops)}/{len(loops)}",
        "required_calls_parsed": f"{sum(loop['calls_parsed'] for loop in required)}/{len(required)}",
        "schema_answers_valid": f"{sum(answer['valid'] for answer in answers)}/{len(answers)}",
        "later_turns_cached_tokens": later,
        "every_later_turn_cached": all(cached > 0 for cached in later),
    }
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "commit": commit(),
            "machine": platform.processor() or platform.machine(), "model": args.model,
            "threads": args.threads, "command": " ".join(["benchmarks/bench_agent.py", *sys.argv[1:]]),
            "server_command": " ".join(["kvcache", *command[3:]]), "summary": summary,
            "agent_loops": loops, "schema_answers": schemas}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-m", "--model", default="qwen2.5-coder-0.5b", help="what kvcache serve -m loads "
                        "(default qwen2.5-coder-0.5b: its template renders tools)")
    parser.add_argument("--threads", type=int, default=2, help="the server's threads (default 2)")
    parser.add_argument("--chat-template", help="a Jinja file the server renders chats with (default: the "
                        "model's own)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="default: results/agent_qwen.json")
    args = parser.parse_args()
    results = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results["summary"], indent=1))
    summary = results["summary"]
    required_parsed, required_all = summary["required_calls_parsed"].split("/")
    valid, answers = summary["schema_answers_valid"].split("/")
    if required_parsed != required_all or valid != answers or not summary["every_later_turn_cached"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
