"""A gateway in a child process for the latency benches (auth, remote hop, Envoy hop): a
backend that answers at once, serving on a free port, and the wait for /health."""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from statistics import quantiles
from typing import Any

import httpx

from backends.base import (
    BackendStats,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    TokenInfo,
    Usage,
)


class InstantBackend:
    """`tokens` one-word tokens at once, no model: what is left is HTTP and gateway work."""

    def __init__(self, name: str, tokens: int) -> None:
        self.name = name
        self.tokens = tokens

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def health(self) -> Health:
        return Health(True)

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, max_input_tokens=4095, max_total_tokens=8192)

    def stats(self) -> BackendStats:
        return BackendStats()

    def count_tokens(self, req: GenerationRequest) -> int:
        words = (req.prompt or "").split()
        return len(words) + sum(len(str(m["content"]).split()) for m in req.messages or [])

    async def _events(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        for i in range(self.tokens):
            last = i == self.tokens - 1
            yield GenerationEvent(
                text=f" w{i}", tokens=(TokenInfo(id=i, text=f" w{i}"),),
                finish_reason="length" if last else None,
                usage=Usage(self.count_tokens(req), self.tokens) if last else None,
            )

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        return self._events(req)


def serve_app(app: Any, port_file: str) -> None:
    """Serve `app` on a free loopback port, written to `port_file` once bound."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    Path(port_file).write_text(str(sock.getsockname()[1]))
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    uvicorn.Server(config).run(sockets=[sock])


def wait_for_gateway(port_file: Path, name: str, timeout_s: float = 60) -> str:
    """The URL of the child gateway that writes `port_file`, once its /health says 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if port_file.exists() and port_file.read_text():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    raise SystemExit(f"gateway {name} did not start")


def percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` (seconds), in milliseconds."""
    cuts = quantiles(samples, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000

