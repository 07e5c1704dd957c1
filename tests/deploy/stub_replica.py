"""A stand-in gateway replica behind the real Envoy, for what a real one will not do on cue.

Envoy's retry policy is about what an upstream does after a request reached it: answer 503
(a queue timeout; a draining replica, which marks its refusal as before any work) or drop the
connection mid-request (a crash). A real
replica does these only under load or when killed at the right instant; this one does them
on every POST, and counts the POSTs it received, which is what the tests assert on.
`/health` answers 200 (Envoy's active health check), `/metrics` a page of series.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import urlsplit

Behaviour = Literal["ok", "503", "draining", "reset"]
METRICS_PAGE = b'switchyard_key_tokens_total{key_id="key_secret"} 1\n'


@dataclass
class Received:
    method: str
    path: str


@dataclass
class StubReplica:
    name: str
    behaviour: Behaviour = "ok"
    received: list[Received] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _connections: set[socket.socket] = field(default_factory=set)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.server_address[1]

    def posts(self) -> int:
        return sum(1 for r in self.received if r.method == "POST")

    def start(self, port: int = 0) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        """As a killed process: the listening socket and every open connection closed, so
        new connections are refused."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for connection in list(self._connections):
            try:
                connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _handler(replica: StubReplica) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            return None

        def setup(self) -> None:
            super().setup()
            replica._connections.add(self.connection)

        def finish(self) -> None:
            replica._connections.discard(self.connection)
            try:
                super().finish()
            except OSError:
                pass

        def do_GET(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path == "/health":
                self._answer(200, b'{"status": "ok"}')
                return
            replica.received.append(Received("GET", self.path))
            if urlsplit(self.path).path == "/metrics":
                self._answer(200, METRICS_PAGE, "text/plain")
            else:
                self._answer(200, json.dumps({"path": self.path}).encode())

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            replica.received.append(Received("POST", self.path))
            if replica.behaviour == "reset":  # the request arrived; the replica dies
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True
                return
            if replica.behaviour == "draining":  # as gateway/drain.py refuses
                self._answer(503, b'{"error": {"code": "server_shutting_down"}}',
                             extra={"Retry-After": "1", "x-switchyard-unprocessed": "1"})
                return
            if replica.behaviour == "503":
                self._answer(503, b'{"error": {"code": "queue_timeout"}}',
                             extra={"Retry-After": "1"})
                return
            self._answer(200, json.dumps({"served_by": replica.name}).encode())

        def _answer(self, status: int, body: bytes, kind: str = "application/json",
                    extra: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (extra or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    return Handler
