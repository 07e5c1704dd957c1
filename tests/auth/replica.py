"""One gateway replica for the auth tests, run as its own process.

Serves `tiny` (the real native engine on a tiny random Llama) and `slow` (the echo
stand-in, 50 ms a token: for parallel-cap tests, where only timing matters). Keys,
limits and usage live in the Redis of SWITCHYARD_REDIS_URL; the admin key comes
from SWITCHYARD_ADMIN_KEY. Logs everything at DEBUG to stderr.

    python -m tests.auth.replica --tiny PATH --port-file FILE
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path

import uvicorn

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.echo_backend import EchoBackend

TINY, SLOW = "tiny", "slow"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tiny", required=True)
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args()
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine = EngineConfig(model=args.tiny, served_model_name=TINY, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
                          compile=False)
    backends = {TINY: NativeBackend(engine),
                SLOW: EchoBackend(name=SLOW, max_total_tokens=100_000, delay_s=0.05)}
    app = create_app(Settings(model_id="unused"), backends=backends)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    Path(args.port_file).write_text(str(sock.getsockname()[1]))
    config = uvicorn.Config(app, log_level="debug", lifespan="on", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
