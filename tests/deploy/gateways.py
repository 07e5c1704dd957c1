"""Gateway replicas as `switchyard serve` processes, as docker-compose.yml runs them.

Each replica serves the models of one config file on its own loopback port, with
keys, limits and usage in a shared Redis (SWITCHYARD_REDIS_URL) and an admin key
(SWITCHYARD_ADMIN_KEY), as in compose. A replica can be killed and started again
on the same port.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
# Tiny models, float32, eager: quick to load, decode and compare.
TINY_OPTIONS = {"dtype": "float32", "compile": False, "max_total_tokens": 512,
                "max_batch_total_tokens": 4096, "block_size": 8, "num_threads": 1}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def write_models_file(path: Path, models: dict[str, Path]) -> Path:
    """A `--config-file` serving `models` ({served name: model folder})."""
    declared: list[dict[str, Any]] = [
        {"name": name, "model_id": str(folder), "options": dict(TINY_OPTIONS)}
        for name, folder in models.items()
    ]
    path.write_text(yaml.safe_dump({"models": declared}))
    return path


def _serve_argv(config_file: Path, port: int) -> list[str]:
    script = Path(sys.executable).parent / "switchyard"
    head = [str(script)] if script.is_file() else [sys.executable, "-m", "gateway.cli"]
    return [*head, "serve", "--config-file", str(config_file), "--hostname", "127.0.0.1",
            "--port", str(port)]


class GatewayProcess:
    """`switchyard serve` on a fixed port, as a process that can be killed and restarted;
    with keys in `redis_url` and `admin_key` when given, open otherwise."""

    def __init__(self, name: str, folder: Path, config_file: Path, redis_url: str | None = None,
                 admin_key: str | None = None) -> None:
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / f"{name}.log"
        self.argv = _serve_argv(config_file, self.port)
        # PYTHONPATH: the replicas run this checkout's code, whatever the venv points at.
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        if redis_url is not None:
            self.env["SWITCHYARD_REDIS_URL"] = redis_url
        if admin_key is not None:
            self.env["SWITCHYARD_ADMIN_KEY"] = admin_key
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited:\n{self.logs()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready:\n{self.logs()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: a crash, not a graceful shutdown."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
