"""A gateway process for the limits, drain and crash tests, launched as `switchyard serve`
launches one (gateway/drain.py's server), serving echo stand-ins instead of models:
`echo` (64-token context) and `slow` (100k tokens, SLOW_DELAY_S a token). Settings come from
SWITCHYARD_* variables (limits, --shutdown-timeout, Redis, the admin key).

    python -m tests.gateway.drain_server --port-file FILE

`GatewayProcess.start(env, folder)` spawns one and waits for /health 200.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
SLOW_DELAY_S = 0.1


def main() -> None:
    from gateway.app import create_app
    from gateway.drain import build_server
    from gateway.settings import Settings
    from tests.gateway.echo_backend import EchoBackend

    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings(model_id="unused")
    backends = {"echo": EchoBackend(name="echo"),
                "slow": EchoBackend(name="slow", max_total_tokens=100_000, delay_s=SLOW_DELAY_S)}
    app = create_app(settings, backends=backends)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    partial = Path(args.port_file + ".part")
    partial.write_text(str(sock.getsockname()[1]))
    partial.rename(args.port_file)
    build_server(app, settings).run(sockets=[sock])


@dataclass
class GatewayProcess:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    @classmethod
    def start(cls, folder: Path, env: dict[str, str], name: str = "gateway") -> GatewayProcess:
        return cls.spawn(folder, env, name).ready(folder / f"{name}.port")

    @classmethod
    def spawn(cls, folder: Path, env: dict[str, str], name: str = "gateway") -> GatewayProcess:
        """Started, not yet ready: call `ready(folder / f"{name}.port")`."""
        log = folder / f"{name}.log"
        full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gateway.drain_server", "--port-file",
                 str(folder / f"{name}.port")],
                cwd=REPO, env=full_env, stdout=out, stderr=subprocess.STDOUT)
        return cls("", proc, log)

    def ready(self, port_file: Path) -> GatewayProcess:
        self.url = self._wait_ready(port_file)
        return self

    def _wait_ready(self, port_file: Path) -> str:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the gateway exited:\n{self.logs()[-3000:]}")
            if port_file.exists():
                url = f"http://127.0.0.1:{port_file.read_text()}"
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.05)
        raise RuntimeError(f"the gateway did not get ready:\n{self.logs()[-3000:]}")

    def logs(self) -> str:
        return self.log.read_text(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


if __name__ == "__main__":
    main()
