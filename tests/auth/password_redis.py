"""A real redis-server that requires a password (of the default user, or of a named ACL user),
started from a given command line.

The deployment tests pass the exact `redis-server ...` command a compose file or manifest
gives Redis; only the port, bind address and data folder are set here (replaced where the
command names them), so what is tested is what ships.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import redis

from tests.auth.conftest import free_port


class PasswordRedis:
    def __init__(self, folder: Path, command: Sequence[str], password: str,
                 username: str | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; run scripts/setup.sh")
        if not command or Path(command[0]).name != "redis-server":
            raise ValueError(f"not a redis-server command: {command}")
        self.port = free_port()
        self.password = password
        self.username = username
        local = {"--port": str(self.port), "--bind": "127.0.0.1", "--dir": str(folder)}
        self.argv = [binary, *_replaced(list(command[1:]), local), "--save", ""]
        self.proc: subprocess.Popen[bytes] | None = None

    def send(self, *commands: Sequence[str]) -> list[bytes]:
        """Each command in RESP on one fresh connection, no client library in between; the
        first line of each reply (`+OK`, `-NOAUTH ...`)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            replies = []
            for command in commands:
                parts = [f"*{len(command)}\r\n".encode()]
                for arg in command:
                    parts.append(f"${len(arg.encode())}\r\n{arg}\r\n".encode())
                sock.sendall(b"".join(parts))
                replies.append(_read_line(sock))
            return replies

    def client(self, password: str | None = None) -> redis.Redis:
        username = self.username if password is not None else None
        return redis.Redis(port=self.port, username=username, password=password,
                           decode_responses=True, socket_timeout=5)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                with self.client(self.password) as client:
                    if client.ping():
                        return
            except redis.RedisError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start: {self.argv}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


def _replaced(args: list[str], values: dict[str, str]) -> list[str]:
    """`args` with each `--name value` of `values` set to its value (appended if absent)."""
    for name, value in values.items():
        if name in args:
            args[args.index(name) + 1] = value
        else:
            args += [name, value]
    return args


def _read_line(sock: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\r\n"):
        chunk = sock.recv(1)
        if not chunk:
            break
        line += chunk
    return line.rstrip(b"\r\n")
