"""Serving the app with uvicorn: bound to 127.0.0.1 unless told otherwise; on SIGTERM or Ctrl-C it
stops accepting connections, lets running requests finish for up to `drain_s` seconds, then
cancels what is left and returns (the command exits 0)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn


def serve(
    app,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_s: float = 30.0,
    sock: socket.socket | None = None,
    log_level: str = "info",
) -> None:
    """Run `app` until a shutdown signal. sock: an already bound socket (port 0 in tests)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=drain_s,
        lifespan="on",
        access_log=False,
    )
    server = uvicorn.Server(config)
    with _signals_already_handled():
        server.run(sockets=[sock] if sock is not None else None)


@contextlib.contextmanager
def _signals_already_handled():
    """uvicorn re-raises the signal that stopped it once it has drained, through the handler that
    was there before it; with the default one SIGTERM would kill the process (exit -15) and SIGINT
    print a KeyboardInterrupt traceback. The drain is the answer to the signal, so the handler
    that is there before is a no-op and the command returns normally."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, lambda *_: None) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (`sock.getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock
