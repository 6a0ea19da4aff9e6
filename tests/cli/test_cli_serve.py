"""`kvcache serve` as a process: it prints where it listens, answers, and on SIGTERM stops
accepting, lets the running request finish, and exits 0."""

from __future__ import annotations

import json
import re
import signal

import httpx
import pytest
from serve_process import start_serve, stop_serve
from waiting import wait_for

from kvcache.cli import main

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)


def test_serve_answers_then_drains_on_sigterm_and_exits_zero():
    process, base = start_serve("--drain-seconds", "60")
    try:
        body = {"prompt": "Once", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
        texts, finish = [], []
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                choice = json.loads(line[6:])["choices"][0]
                if not texts:
                    process.send_signal(signal.SIGTERM)  # mid-stream: the answer must still complete
                texts.append(choice["text"])
                finish.append(choice["finish_reason"])
        assert finish[-1] == "length"
        assert process.wait(60) == 0
        refused = None
        try:
            httpx.get(f"{base}/health", timeout=5)
        except httpx.TransportError as error:
            refused = error
        assert refused is not None  # no longer accepting
        assert "stopped" in process.stdout.read()
        log = process.stderr.read()  # the access log: a line for the request
        assert "127.0.0.1 POST /v1/completions 200 stream; prompt" in log and "tokens, length" in log
    finally:
        if process.poll() is None:
            process.kill()


def test_serve_refuses_bad_arguments(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    assert "kvcache serve: error:" in capsys.readouterr().err


def test_a_port_in_use_is_said_before_the_model_loads(capsys, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        # a model path that does not exist: had it been loaded first, that would be the error
        assert main(["serve", "-m", str(tmp_path / "absent"), "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err


def test_a_ctx_size_past_the_model_or_the_pool_is_refused_by_name(capsys):
    assert main(["serve", "--port", "0", "--ctx-size", "1000000"]) == 2
    assert "past the model's context" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "--kv-budget", "1MiB", "--ctx-size", "1000"]) == 2
    err = capsys.readouterr().err
    assert "the KV pool holds" in err and "raise --kv-budget or lower --ctx-size" in err


def test_kv_pin_prefills_its_prompts_at_start_and_a_bad_file_is_named_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"a fine prompt"\n{"not": "a prompt"}\n')
    assert main(["serve", "--port", "0", "--kv-pin", str(bad), "-m", str(tmp_path / "absent")]) == 2
    assert "line 2: expected a text or a list of chat messages" in capsys.readouterr().err
    pins = tmp_path / "pins.jsonl"
    system = "You are a terse assistant. " * 6
    pins.write_text(json.dumps(system) + "\n")
    process, base = start_serve("--kv-pin", str(pins), "--block-size", "8")
    try:
        body = {"prompt": system + "Hello", "max_tokens": 2, "temperature": 0}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # prefilled at start
        assert "pinned 1 prompts" in stop_serve(process)[1]
    finally:
        if process.poll() is None:
            process.kill()


def test_kv_events_reach_a_subscriber_and_a_bad_endpoint_is_named_before_loading(tmp_path, capsys):
    import socket

    import zmq

    absent = str(tmp_path / "absent")  # had the model been loaded first, that would be the error
    assert main(["serve", "--port", "0", "-m", absent, "--kv-events", "127.0.0.1:5557"]) == 2
    assert "--kv-events must be a ZeroMQ endpoint" in capsys.readouterr().err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        assert main(["serve", "--port", "0", "-m", absent, "--kv-events", endpoint]) == 2
    assert f"--kv-events: cannot bind {endpoint}" in capsys.readouterr().err
    assert main(["serve", "--port", "0", "-m", absent, "--kv-events-replay", "tcp://127.0.0.1:5558"]) == 2
    assert "--kv-events-replay replays --kv-events' batches: give --kv-events too" in capsys.readouterr().err
    process, base = start_serve("--kv-events", endpoint, "--kv-events-topic", "kv@a@m", "--block-size", "8")
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    try:
        subscriber.connect(endpoint)
        subscriber.setsockopt(zmq.SUBSCRIBE, b"kv@a@m")
        heard: list[bytes] = []

        def stored() -> bool:  # requests until a batch with a stored block arrives (PUB drops early ones)
            httpx.post(f"{base}/v1/completions", json={"prompt": "Once upon a time " * 4, "max_tokens": 2},
                       timeout=60)
            while subscriber.poll(200):
                heard.append(subscriber.recv_multipart()[2])
            return any(b"BlockStored" in payload for payload in heard)

        wait_for(stored, 60)
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert re.search(r"^kvcache_kv_cache_utilization \d", metrics, re.M)
        assert "KV events: bound at " + endpoint in stop_serve(process)[0]
    finally:
        subscriber.close(0)
        context.term()
        if process.poll() is None:
            process.kill()


def test_per_process_flags_with_replicas_are_refused_by_name(tmp_path, capsys):
    code = main(["serve", "--port", "0", "--replicas", "2", "--kv-disk", str(tmp_path),
                 "--kv-events", "tcp://127.0.0.1:5599"])
    assert code == 2
    err = capsys.readouterr().err
    assert "--kv-events, --kv-disk cannot be used with --replicas" in err and "--kv-store" in err


def test_routing_imbalance_reaches_start_replicas_and_a_negative_one_is_refused(monkeypatch, capsys):
    asked = {}

    def start_replicas(settings, replicas, **options):
        asked.update(options, replicas=replicas)
        raise ValueError("no cluster in this test")

    monkeypatch.setattr("kvcache.replicas.replica_set.start_replicas", start_replicas)
    assert main(["serve", "--port", "0", "--replicas", "3", "--routing-imbalance", "2"]) == 2
    assert asked["replicas"] == 3 and asked["imbalance"] == 2 and asked["policy"] == "prefix"
    assert "no cluster in this test" in capsys.readouterr().err

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "0", "--replicas", "2", "--routing-imbalance", "-1"])
    assert exit_.value.code == 2
    assert "argument --routing-imbalance: expected an integer >= 0, got -1" in capsys.readouterr().err
