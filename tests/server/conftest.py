"""A real kvcache server on a free 127.0.0.1 port (uvicorn on a thread), on the bundled model."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import uvicorn
from waiting import wait_for  # noqa: F401 (the server tests import it from here)

import kvcache
from kvcache.engine import Engine
from kvcache.server import ServerSettings, bind, build_app

API_KEY = "test-key-not-secret"


@pytest.fixture(scope="session")
def model():
    return kvcache.load_model()


@pytest.fixture(scope="session")
def tokenizer():
    return kvcache.load_tokenizer()


class RunningServer(SimpleNamespace):
    """url (…/v1), base (the origin), engine, settings; stop() ends it."""


def start_server(model, tokenizer, settings: ServerSettings, **engine_options) -> RunningServer:
    engine = Engine(model, tokenizer, **{"num_blocks": 512, "block_size": 8, **engine_options})
    app = build_app(engine, tokenizer, settings)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)

    def stop() -> None:
        server.should_exit = True
        thread.join(15)
        sock.close()

    base = f"http://127.0.0.1:{port}"
    return RunningServer(url=f"{base}/v1", base=base, engine=engine, settings=settings, stop=stop)


@pytest.fixture(scope="module")
def server(model, tokenizer):
    running = start_server(
        model,
        tokenizer,
        ServerSettings(model_name="kvcache-test", api_key=API_KEY, max_body_bytes=64 << 10),
        max_running=8,
        token_budget=128,
    )
    yield running
    running.stop()
