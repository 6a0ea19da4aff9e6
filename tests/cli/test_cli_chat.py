"""`kvcache chat` for three turns through a pipe and in a pseudo-terminal: each reply is the
greedy answer to the conversation so far, and later turns reuse the cache (only the new turn is
prefilled)."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
import time

import pytest

import kvcache
from kvcache.reuse.prefix import ChatSession
from kvcache.text.eos import default_eos

pytestmark = pytest.mark.processes  # (the fast lane, pytest --fast, leaves it out)

TURNS = ["What is a class?", "And a function?", "Thanks."]
STATS = re.compile(r"\[reused (\d+) tokens from the cache, prefilled (\d+); (\d+) new tokens")


def _command(*extra: str) -> list[str]:
    return [sys.executable, "-m", "kvcache", "chat", "--max-tokens", "16", "--threads", "1", *extra]


def _expected_replies() -> list[str]:
    model, tokenizer = kvcache.load_model(), kvcache.load_tokenizer()
    session = ChatSession(model, tokenizer, num_blocks=512)
    eos = default_eos(model.config.eos_token_id, tokenizer)
    return [session.send(turn, max_new_tokens=16, eos_token_id=eos) for turn in TURNS]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    return _expected_replies()


def test_three_turns_through_a_pipe(expected):
    stdin = "\n".join([TURNS[0], "/help", TURNS[1], TURNS[2]]) + "\n"
    done = subprocess.run(_command(), input=stdin, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "".join(reply + "\n" for reply in expected)
    stats = [tuple(map(int, m)) for m in STATS.findall(done.stderr)]
    assert len(stats) == 3 and "/reset" in done.stderr  # the help line
    assert stats[0][0] == 0 and all(reused > 0 for reused, _, _ in stats[1:])
    assert all(prefilled < reused for reused, prefilled, _ in stats[1:])  # only the new turn ran
    assert done.stderr.index("warming up (untimed)") < done.stderr.index("[reused")  # none timed in it


def test_a_ctx_size_past_the_models_context_is_refused_by_name(capsys):
    from kvcache.cli import main

    assert main(["chat", "--ctx-size", "1000000"]) == 2
    assert "past the model's context" in capsys.readouterr().err


def test_a_repetition_penalty_reaches_the_replies_and_a_bad_min_p_is_refused_by_name(expected, capsys):
    from kvcache.cli import main

    model, tokenizer = kvcache.load_model(), kvcache.load_tokenizer()
    eos = default_eos(model.config.eos_token_id, tokenizer)
    penalized = ChatSession(model, tokenizer, num_blocks=512).send(
        TURNS[0], max_new_tokens=16, eos_token_id=eos, repetition_penalty=1.8)
    done = subprocess.run(_command("--repetition-penalty", "1.8"), input=TURNS[0] + "\n", capture_output=True,
                          text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == penalized + "\n" and penalized != expected[0]
    assert main(["chat", "--min-p", "2"]) == 2
    assert "min_p must be a finite number in [0, 1], got 2.0" in capsys.readouterr().err


def test_reset_and_exit_through_a_pipe(expected):
    stdin = f"{TURNS[0]}\n/reset\n{TURNS[0]}\n/exit\nnever read\n"
    done = subprocess.run(_command(), input=stdin, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == (expected[0] + "\n") * 2
    assert [int(m[0]) for m in STATS.findall(done.stderr)] == [0, 0]  # a new conversation: nothing reused


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal (POSIX)")
def test_three_turns_in_a_pseudo_terminal(expected):
    leader, follower = os.openpty()
    process = subprocess.Popen(_command(), stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    seen = b""

    def read_until(marker: bytes, count: int, timeout: float = 120) -> None:
        """Read the terminal until `marker` has appeared `count` times."""
        nonlocal seen
        deadline = time.monotonic() + timeout
        while seen.count(marker) < count:
            left = deadline - time.monotonic()
            assert left > 0, f"waited for {marker!r} x{count}; got {seen[-500:]!r}"
            ready, _, _ = select.select([leader], [], [], left)
            if ready:
                seen += os.read(leader, 4096)

    try:
        read_until(b">>> ", 1)
        for count, turn in enumerate(TURNS, start=1):
            os.write(leader, turn.encode() + b"\n")
            read_until(b"tokens held]", count)
            read_until(b">>> ", count + 1)
        os.write(leader, b"/exit\n")
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
        os.close(leader)
    text = seen.decode("utf-8", "replace").replace("\r\n", "\n")
    for reply in expected:
        assert reply in text
    assert len(STATS.findall(text)) == 3


def test_a_chat_with_kv_disk_starts_from_the_blocks_an_earlier_chat_left(tmp_path):
    system = "You answer questions about Python. " * 8  # several whole blocks before the first turn
    command = _command("--kv-disk", str(tmp_path), "--system", system)
    runs = [subprocess.run(command, input=f"{TURNS[0]}\n", capture_output=True, text=True, timeout=180,
                           check=False) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[-1].stderr
    first, second = (tuple(map(int, STATS.findall(run.stderr)[0])) for run in runs)
    assert first[0] == 0 and second[0] > 0 and second[1] < first[1]  # read from disk, less prefilled
    assert runs[0].stdout == runs[1].stdout  # the same answer
