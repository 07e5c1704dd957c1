"""Graceful drain: on SIGTERM (or SIGINT) finish what is in flight, then exit 0.

uvicorn's own graceful shutdown closes the listening socket at once, so a load balancer
that probes `/health` sees refused connections rather than a 503, and idle kept-alive
connections are dropped under their clients. Here the first signal starts a drain instead:

1. The listener stays open. `/health` answers 503 (`"status": "draining"`), so Envoy or a
   Kubernetes probe stops routing here; any other new request gets 503 in OpenAI's shape
   (TGI's on TGI's routes) with `Connection: close`, so its client reconnects elsewhere.
2. Requests already in flight, streams included, run to their end; each one settles its
   usage in Redis as it ends (gateway/guard.py), before its response completes.
3. When none is left, or after `--shutdown-timeout` seconds (whatever is still running is
   then cancelled, which also settles it, and given a few seconds to do so), uvicorn's
   shutdown runs: listener and connections closed, backends and Redis closed, exit 0.

A second SIGTERM or SIGINT exits at once (status 128 + the signal's number). A process
killed outright (SIGKILL) settles nothing; the parallel-request slots it held expire after
`--auth-lease-ttl` seconds, and its token reservations leave the window as usual.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from types import FrameType

import anyio
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.error_shapes import shaped_response
from gateway.errors import RETRY_AFTER_S, OpenAIError, tgi_error_response
from gateway.log_format import log_config
from gateway.settings import Settings

log = logging.getLogger("switchyard.gateway")
EXEMPT = frozenset({"/health", "/metrics"})  # still answered while draining
# On a refusal before any work: a proxy may send the request to another replica (Envoy's
# retriable_headers in envoy/envoy.yaml), as it may not for other 503s.
UNPROCESSED_HEADER = "x-switchyard-unprocessed"
TGI_PATHS = frozenset({"/generate", "/generate_stream", "/", "/info"})
CANCEL_GRACE_S = 5.0  # for requests cancelled at the timeout to settle their usage


class Drain:
    """Whether the server is draining, and the requests in flight (a cancel scope each)."""

    def __init__(self) -> None:
        self.draining = False
        self.scopes: set[anyio.CancelScope] = set()

    @property
    def in_flight(self) -> int:
        return len(self.scopes)

    def cancel_all(self) -> None:
        for scope in list(self.scopes):
            scope.cancel()


def drain_of(app: FastAPI) -> Drain:
    return app.state.drain


def shutting_down() -> OpenAIError:
    return OpenAIError(
        503, "The server is shutting down and accepts no new requests; retry on another "
             "replica.", code="server_shutting_down",
        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close",
                 UNPROCESSED_HEADER: "1"})


class DrainMiddleware:
    """Counts requests in flight; while draining, refuses new ones (except EXEMPT)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in EXEMPT:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = shutting_down()
            path = scope["path"]
            response = tgi_error_response(err) if path in TGI_PATHS else (
                shaped_response(path, err) or err.response())
            await response(scope, receive, send)
            return
        # Cancelled at --shutdown-timeout; what the request holds is released under shields.
        with anyio.CancelScope() as cancel:
            self.drain.scopes.add(cancel)
            try:
                await self.app(scope, receive, send)
            finally:
                self.drain.scopes.discard(cancel)


def _exit_now(sig: int) -> None:
    sys.stderr.write(f"switchyard: signal {sig} again while draining: exiting now\n")
    sys.stderr.flush()
    os._exit(128 + sig)


class DrainingServer(uvicorn.Server):
    """uvicorn, draining (see the module doc) before its own shutdown."""

    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._signal: int | None = None
        self._deadline = 0.0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's: it would re-raise the signal after shutdown (exit status 143).
        if self._signal is not None or self.should_exit:
            _exit_now(sig)
        self._signal = sig  # the next tick starts the drain

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter) or self._signal is None:
            return self.should_exit
        now = time.monotonic()
        if not self.drain.draining:
            self.drain.draining = True
            self._deadline = now + self.timeout_s
            log.info("draining: signal %d; %d request(s) in flight, waiting up to %.0fs",
                     self._signal, self.drain.in_flight, self.timeout_s)
        if self.drain.in_flight and now < self._deadline:
            return False
        if self.drain.in_flight:
            await self._cancel_in_flight()
        log.info("drained: shutting down")
        self.config.timeout_graceful_shutdown = CANCEL_GRACE_S
        return True

    async def _cancel_in_flight(self) -> None:
        log.warning("drain: --shutdown-timeout passed; cancelling %d request(s)",
                    self.drain.in_flight)
        self.drain.cancel_all()
        deadline = time.monotonic() + CANCEL_GRACE_S
        while self.drain.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


def build_server(app: FastAPI, settings: Settings) -> DrainingServer:
    """The server `switchyard serve` runs: `app` on the settings' address, draining on
    SIGTERM for up to `settings.shutdown_timeout` seconds."""
    config = uvicorn.Config(
        app, host=settings.hostname, port=settings.port, log_level=settings.log_level,
        timeout_graceful_shutdown=max(settings.shutdown_timeout, 1.0),
        # our handlers and format for uvicorn's loggers; our access line, not uvicorn's
        log_config=log_config(settings.log_level, settings.log_format), access_log=False)
    return DrainingServer(config, drain_of(app), settings.shutdown_timeout)
