"""Serving the app: uvicorn on a thread of its own, the engine's steps on the calling thread; bound
to 127.0.0.1 unless told otherwise. On SIGTERM or Ctrl-C it stops accepting connections, lets
running requests finish for up to `drain_s` seconds, then cancels what is left and returns (the
command exits 0)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading

import uvicorn


def serve(
    app,
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_s: float = 30.0,
    sock: socket.socket | None = None,
    log_level: str = "info",
) -> None:
    """Run `app` (built on `engine`) until a shutdown signal. sock: an already bound socket.

    Why the engine runs on this thread: the model was loaded here, and torch and the compiled
    kernels share one OpenMP runtime, which lets its idle threads spin between parallel regions
    (waking at once) only while the process's threads in teams fit its cores; a second thread
    with a team of its own (an engine thread beside the loading thread) turns the spinning off
    for every team, and each of a step's many short kernels then waits for its threads to be
    woken (docs/serve.md). The HTTP side does no parallel work, so it takes the other thread."""
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
    failure: list[BaseException] = []

    def run_http() -> None:
        try:
            server.run(sockets=[sock] if sock is not None else None)
        except BaseException as error:  # noqa: BLE001 (raised again on the calling thread)
            failure.append(error)
        finally:
            engine.stop()

    http = threading.Thread(target=run_http, name="kvcache-http", daemon=True)
    with _shutdown_on_signals(server):
        engine.run(until=lambda: not http.is_alive(), started=http.start)
        http.join()
    if failure:
        raise failure[0]


@contextlib.contextmanager
def _shutdown_on_signals(server: uvicorn.Server):
    """SIGINT and SIGTERM ask uvicorn to drain and stop (a second one: to stop at once). uvicorn
    on a thread other than the main one installs no handlers of its own; off the main thread
    (tests) none are installed here either."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def shut_down(signum, frame) -> None:
        if server.should_exit:
            server.force_exit = True
        server.should_exit = True

    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, shut_down) for sig in handled}
    try:
        yield
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it when it starts
    serving); port 0 picks a free one (`sock.getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # not listening: nothing connects while the model loads
    return sock
