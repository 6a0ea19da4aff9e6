"""`kvcache serve` and Ctrl-C: the first says on stderr how many running requests it waits for
and how to stop now; a second stops promptly, each running stream still ending with its events,
with no traceback and exit status 130."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading

import httpx
import pytest
from test_cli_signals import AS_FROM_A_SHELL
from waiting import wait_for

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

STREAMS = 4


def _read_lines(stream, into: list[str]) -> threading.Thread:
    def read() -> None:
        for line in stream:
            into.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader


def _stream(base: str, events: list[str]) -> None:
    """One long streamed completion; its `data:` lines into `events`, or the error that cut it."""
    body = {"prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True, "temperature": 0}
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as response:
            events.extend(line for line in response.iter_lines() if line.startswith("data: "))
    except httpx.HTTPError as error:
        events.append(f"cut: {type(error).__name__}")


def test_a_first_ctrl_c_says_what_it_waits_for_and_a_second_stops_now_without_a_traceback():
    command = [sys.executable, "-c", AS_FROM_A_SHELL, "serve", "--port", "0", "--threads", "1",
               "--drain-seconds", "120"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out: list[str] = []
    err: list[str] = []
    readers = [_read_lines(process.stdout, out), _read_lines(process.stderr, err)]
    try:
        assert wait_for(lambda: out or process.poll() is not None, timeout=120), "no start-up line"
        base = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", out[0]).group(1)
        streams = [[] for _ in range(STREAMS)]
        clients = [threading.Thread(target=_stream, args=(base, events)) for events in streams]
        for client in clients:
            client.start()
        assert wait_for(lambda: all(len(events) >= 2 for events in streams), timeout=60)  # all generating
        process.send_signal(signal.SIGINT)
        assert wait_for(lambda: any("Ctrl-C again to stop now" in line for line in err), timeout=30), err
        said = next(line for line in err if "again to stop now" in line)
        assert f"finishing {STREAMS} running requests" in said
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
        for thread in (*clients, *readers):
            thread.join(60)
        text = "".join(err)
        assert f"stopping now: cancelling {STREAMS} running requests" in text
        assert "Traceback" not in text and "ERROR" not in text
        for events in streams:  # each stream ended in order: its error event, then [DONE]
            assert events[-1] == "data: [DONE]", events[-2:]
            assert "cancelled" in json.loads(events[-2][6:])["error"]["message"]
    finally:
        if process.poll() is None:
            process.kill()
