"""An upstream's address never reaches a client, and its secrets never reach the log."""

from __future__ import annotations

import logging
import socket

import pytest

from backends.base import DeploymentError
from backends.registry import BackendSpec, create_backend
from backends.remote.redact import redact_text, redact_url
from tests.backends.harness import request


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    return port


async def test_a_refused_connection_names_no_address_and_logs_no_secret(
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = _closed_port()
    backend = create_backend(BackendSpec(name="m", model_id="unused", backend="remote", options={
        "base_url": f"http://127.0.0.1:{port}/v1?api-key=sekrit-123", "connect_timeout": 1}))
    await backend.start()
    try:
        with caplog.at_level(logging.DEBUG), pytest.raises(DeploymentError) as caught:
            await anext(backend.generate(request("hi")))
    finally:
        await backend.close()
    message = caught.value.message
    assert caught.value.code == "upstream_unreachable" and "connect" in message
    assert "127.0.0.1" not in message and str(port) not in message and "sekrit" not in message
    assert "sekrit" not in caplog.text
    assert f"127.0.0.1:{port}/v1?api-key=***" in caplog.text  # the operator sees where


@pytest.mark.parametrize(("url", "shown"), [
    ("https://bob:hunter2@llm.example:8443/v1?key=s3&mode=x",
     "https://***@llm.example:8443/v1?key=***&mode=***"),
    ("http://10.0.0.5:8000/v1", "http://10.0.0.5:8000/v1"),
    ("http://[::1]:8000/v1?token", "http://[::1]:8000/v1?***"),
])
def test_urls_are_logged_without_their_secrets(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert redact_text(f"failed: {url} (refused)") == f"failed: {shown} (refused)"
