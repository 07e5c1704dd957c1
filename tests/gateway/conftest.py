"""Gateway test fixtures: a real uvicorn server on a free port, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import httpx
import openai
import pytest
import uvicorn
from fastapi import FastAPI

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.echo_backend import EchoBackend

ServeApp = Callable[[FastAPI], str]


def _run(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn exits when the lifespan startup fails
        pass


@contextmanager
def running_server(app: FastAPI, timeout_s: float = 10.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1:<free port>; yields the base URL; shuts down on exit."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=_run, args=(server, sock), daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError("uvicorn did not start (see the log above)")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


def _serve_app_factory(stack: ExitStack) -> ServeApp:
    def serve(app: FastAPI) -> str:
        return stack.enter_context(running_server(app))
    return serve


@pytest.fixture
def serve_app() -> Iterator[ServeApp]:
    """`serve_app(app) -> base_url`; every server started is shut down after the test."""
    with ExitStack() as stack:
        yield _serve_app_factory(stack)


@pytest.fixture(scope="module")
def serve_app_module() -> Iterator[ServeApp]:
    """Like `serve_app`, but servers live for the whole test module."""
    with ExitStack() as stack:
        yield _serve_app_factory(stack)


@pytest.fixture(scope="module")
def echo_backends() -> dict[str, EchoBackend]:
    return {
        "echo": EchoBackend(name="echo"),
        "slow": EchoBackend(name="slow", max_total_tokens=100_000, delay_s=0.02),
    }


@pytest.fixture(scope="module")
def gateway_url(serve_app_module: ServeApp, echo_backends: dict[str, EchoBackend]) -> str:
    """One gateway for the module, serving `echo` and `slow` (no aliases)."""
    return serve_app_module(create_app(Settings(), backends=echo_backends))


@pytest.fixture(scope="module")
def client(gateway_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0,
                         timeout=10)


@pytest.fixture(scope="module")
def http(gateway_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway_url, timeout=10) as session:
        yield session
