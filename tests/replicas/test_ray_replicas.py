"""`kvcache serve --replicas 2` on a local Ray cluster, driven by the openai client: every later
turn of 16 conversations finds its earlier turns in the replica it is routed to, the greedy
answers are a single engine's, and a replica killed mid-run is replaced while no request hangs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from openai_streams import streamed_logprobs
from ray import serve
from serve_process import start_serve, stop_serve
from waiting import wait_for

import kvcache
from kvcache.engine import Engine

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

BLOCK = 8
NEW = 12


@pytest.fixture(scope="module")
def server():
    process, base = start_serve("--replicas", "2", "--block-size", str(BLOCK), "--log-level", "warning",
                                timeout_s=600)
    try:
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", timeout=600, max_retries=0)  # (loaded CI)
        stop_serve(process, timeout_s=120)
    finally:
        if process.poll() is None:
            process.kill()


def chat(client, messages: list[dict]):
    return client.chat.completions.create(model="kvcache-default", messages=messages, max_tokens=NEW,
                                          temperature=0)


def test_later_turns_find_their_earlier_turns_and_answers_are_a_single_engines(server):
    conversations = [[{"role": "user", "content": f"Tell me about number {n} and its friends."}]
                     for n in range(16)]
    previous_prompt = [0] * len(conversations)
    with ThreadPoolExecutor(8) as pool:
        for turn in range(3):
            replies = list(pool.map(lambda messages: chat(server, messages), conversations))
            for index, (messages, reply) in enumerate(zip(conversations, replies)):
                cached = reply.usage.prompt_tokens_details.cached_tokens
                if turn:  # every token of the previous turn's prompt, from the same replica
                    assert cached >= previous_prompt[index], (turn, index)
                previous_prompt[index] = reply.usage.prompt_tokens
                messages.append({"role": "assistant", "content": reply.choices[0].message.content})
                messages.append({"role": "user", "content": f"And then, turn {turn + 1}?"})
    model = kvcache.load_model()
    single = Engine(model, kvcache.load_tokenizer(), block_size=BLOCK)
    for messages in conversations:  # each assistant answer is what one engine says to that history
        for end in range(1, len(messages), 2):
            expected = single.generate([messages[:end]], max_tokens=NEW, temperature=0.0)[0].text
            assert messages[end]["content"] == expected


def replica_actors() -> list[str]:
    return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)
            if actor["name"].startswith("SERVE_REPLICA::kvcache#")]


def test_streamed_logprobs_and_a_schema_come_through_a_replica(server):
    messages = [{"role": "user", "content": "A person as JSON."}]
    stream = server.chat.completions.create(model="kvcache-default", messages=messages, max_tokens=NEW,
                                            temperature=0, logprobs=True, top_logprobs=2, stream=True,
                                            stream_options={"include_usage": True})
    items, text, usage = streamed_logprobs(stream)
    assert len(items) == usage.completion_tokens and "".join(item.token for item in items) == "".join(text)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    reply = server.chat.completions.create(model="kvcache-default", messages=messages, max_tokens=NEW,
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "ok", "schema": schema}})
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content in (
        '{"ok":true}', '{"ok":false}')


def running_replicas() -> int:
    status = serve.status().applications["kvcache"].deployments["kvcache-engine"]
    return status.replica_states.get("RUNNING", 0)


def test_a_killed_replica_is_replaced_and_no_request_hangs(server):
    ray.init(address="auto", log_to_driver=False)
    try:
        before = replica_actors()
        assert len(before) == 2
        messages = [[{"role": "user", "content": f"A long story, number {n}."}] for n in range(6)]

        def long_answer(history):
            try:
                return server.chat.completions.create(model="kvcache-default", messages=history,
                                                      max_tokens=400, temperature=0).choices[0].finish_reason
            except openai.APIStatusError as error:  # the requests on the killed replica fail cleanly
                return error.status_code

        with ThreadPoolExecutor(6) as pool:
            answers = [pool.submit(long_answer, history) for history in messages]
            wait_for(lambda: any(not answer.done() for answer in answers), 30)
            ray.kill(ray.get_actor(before[0], namespace="serve"))
            # a hang fails here (bounded; wide enough for a replica restarting on a loaded machine)
            outcomes = [answer.result(timeout=600) for answer in answers]
        assert set(outcomes) <= {"length", "stop", 500}
        wait_for(lambda: running_replicas() == 2 and before[0] not in replica_actors(), 120)
        assert chat(server, messages[0]).choices[0].finish_reason in ("length", "stop")
    finally:
        ray.shutdown()
