"""Auth fixtures: a real redis-server on a free port, and gateway replicas as processes."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(24)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """`redis-server --port N --save '' --appendonly no`, stoppable and restartable.

    `stop(save=True)` writes a snapshot first (SAVE works with `--save ''`), which
    the restart loads: Redis comes back with its keys, as a persistent one would.
    """

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not installed; run scripts/setup.sh")
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.folder), "--dbfilename", "dump.rdb"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.02)

    def command(self, *args: str) -> str:
        import redis

        with redis.Redis(port=self.port, decode_responses=True) as client:
            return str(client.execute_command(*args))

    def stop(self, save: bool = False) -> None:
        if self.proc is None:
            return
        if save:
            self.command("SAVE")
        self.proc.terminate()
        self.proc.wait(10)
        self.proc = None


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis of this test alone (to stop and restart)."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


@dataclass
class Replica:
    name: str
    url: str
    log: Path
    proc: subprocess.Popen[bytes]

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def _spawn(name: str, folder: Path, redis_url: str, tiny: Path) -> tuple[subprocess.Popen, Path]:
    env = {**os.environ, "SWITCHYARD_REDIS_URL": redis_url, "SWITCHYARD_ADMIN_KEY": ADMIN_KEY,
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    port_file = folder / f"{name}.port"
    argv = [sys.executable, "-m", "tests.auth.replica", "--tiny", str(tiny),
            "--port-file", str(port_file)]
    with open(folder / f"{name}.log", "wb") as log:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc, port_file


def _wait_ready(name: str, proc: subprocess.Popen, port_file: Path, log: Path) -> str:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"replica {name} exited:\n{log.read_text()[-3000:]}")
        if port_file.exists() and port_file.read_text():
            url = f"http://127.0.0.1:{port_file.read_text()}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.05)
    raise RuntimeError(f"replica {name} not ready:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def replicas(
    tmp_path_factory: pytest.TempPathFactory, redis_server: RedisServer,
    tiny_model: Callable[[str], Path],
) -> Iterator[tuple[Replica, Replica]]:
    """Two gateway processes sharing one Redis: `a` and `b`."""
    folder = tmp_path_factory.mktemp("replicas")
    tiny = tiny_model("llama_gqa")
    from tests.kernel_cache import machine_kernels

    machine_kernels()  # built here, not inside a replica's readiness deadline
    spawned = {name: _spawn(name, folder, redis_server.url, tiny) for name in ("a", "b")}
    started: list[Replica] = []
    try:
        for name, (proc, port_file) in spawned.items():
            log = folder / f"{name}.log"
            started.append(Replica(name, _wait_ready(name, proc, port_file, log), log, proc))
        yield started[0], started[1]
    finally:
        for proc, _ in spawned.values():
            proc.terminate()
        for proc, _ in spawned.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def create_key(url: str, **options: object) -> dict:
    """A new key through `url`'s admin API; the answer includes the secret (`key`)."""
    response = httpx.post(f"{url}/admin/keys", json=options, headers=admin_headers(), timeout=10)
    assert response.status_code == 201, response.text
    return response.json()
