"""`kvcache serve` as a child process for the tests: started on a free loopback port, its address
read from the first line it prints, stopped with SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading


def start_serve(*extra: str, timeout_s: float = 120) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL http://127.0.0.1:PORT) of `kvcache serve --port 0 --threads 1`
    with `extra` flags; AssertionError with its stderr when no address comes within timeout_s."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvcache", "serve", "--port", "0", "--threads", "1", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVCACHE_API_KEY": "", "RAY_AUTH_MODE": "disabled"},
    )
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    match = re.search(r"on (http://127\.0\.0\.1:\d+)/v1", found[0] if found else "")
    if match is None:
        process.kill()
        raise AssertionError(f"no address printed: {found!r} {process.stderr.read()[-3000:]}")
    return process, match.group(1)


def stop_serve(process: subprocess.Popen, timeout_s: float = 60) -> tuple[str, str]:
    """SIGTERM, a clean exit (status 0), and what the server printed since it started listening:
    (stdout, stderr)."""
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout_s) == 0
    return process.stdout.read(), process.stderr.read()
