"""Serving the app: uvicorn on a thread of its own, the engine's steps on the calling thread; bound
to 127.0.0.1 unless told otherwise. On SIGTERM or Ctrl-C it stops accepting connections, lets
running requests finish for up to `drain_s` seconds, then cancels what is left and returns (the
command exits 0). A second signal cancels them at once: each still gets its answer's end (a 503,
or a stream's error event), so the server stops without cutting a task midway (no traceback)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Callable

import uvicorn

CANCELLED_ANSWER_S = 10.0  # after the drain, how long cancelled requests' answers may take to end


def serve(
    app,
    engine,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    drain_s: float = 30.0,
    sock: socket.socket | None = None,
    log_level: str = "info",
    notify: Callable[[str], None] | None = None,
) -> bool:
    """Run `app` (built on `engine`) until a shutdown signal. sock: an already bound socket.
    notify(line): told what a signal does (how many requests it waits for, how to stop now).
    Returns True when a second signal stopped it before the running requests finished.

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
        timeout_graceful_shutdown=drain_s + CANCELLED_ANSWER_S,  # (the drain's end cancels first)
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
    stopping = _Stopping(server, engine, drain_s, notify or (lambda line: None))
    with _shutdown_on_signals(stopping.on_signal):
        engine.run(until=lambda: not http.is_alive(), started=http.start)
        http.join()
    if failure:
        raise failure[0]
    return stopping.stopped_now


class _Stopping:
    """What SIGINT and SIGTERM do. The first: uvicorn stops accepting and waits for the running
    requests, up to drain_s. The second (or the drain's end): the engine cancels them, so each
    answer ends at once, in order. A third: uvicorn stops at once. The signal handler only
    counts; the saying and the cancelling run on a thread of their own (a handler that printed
    could interrupt a print of its own thread)."""

    def __init__(self, server: uvicorn.Server, engine, drain_s: float, notify: Callable[[str], None]) -> None:
        self.server, self.engine, self.drain_s, self.notify = server, engine, drain_s, notify
        self.signals = 0
        self.again = threading.Event()
        self.stopped_now = False  # a second signal came: its running requests were cancelled

    def on_signal(self, signum, frame) -> None:
        self.signals += 1
        self.server.should_exit = True
        if self.signals == 1:
            name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            threading.Thread(target=self._drain, args=(name,), name="kvcache-stopping", daemon=True).start()
        elif self.signals == 2:
            self.again.set()
        else:
            self.server.force_exit = True

    def _drain(self, name: str) -> None:
        running = len(self.server.server_state.tasks)
        if running:
            self.notify(f"finishing {running} running request{'s' if running != 1 else ''} (up to "
                        f"{self.drain_s:g} s, --drain-seconds); {name} again to stop now")
        else:
            self.notify("stopping")
        self.stopped_now = self.again.wait(self.drain_s)
        why = "stopping now" if self.stopped_now else f"the {self.drain_s:g} s drain ended"
        running = len(self.server.server_state.tasks)
        if running:
            self.notify(f"{why}: cancelling {running} running request{'s' if running != 1 else ''}")
        self.engine.cancel_all()


@contextlib.contextmanager
def _shutdown_on_signals(handler: Callable):
    """SIGINT and SIGTERM call `handler` while serving. uvicorn on a thread other than the main
    one installs no handlers of its own; off the main thread (tests) none are installed here
    either."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handled = (signal.SIGINT, signal.SIGTERM)
    before = {sig: signal.signal(sig, handler) for sig in handled}
    try:
        yield
    finally:
        for sig, handler_before in before.items():
            signal.signal(sig, handler_before)


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening (uvicorn listens on it when it starts
    serving); port 0 picks a free one (`sock.getsockname()`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))  # not listening: nothing connects while the model loads
    return sock
