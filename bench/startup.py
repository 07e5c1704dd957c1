"""Cold vs warm start of the default model: seconds from process start to /health 200.

Starts `switchyard serve --model-id default` with an empty startup cache (cold: GGUF parsing,
tokenizer conversion, int4 repacking and the decode kernel's compile all happen), then again
`--warm` times with the cache the first start filled. Each start prints its load stages as the
server logged them (`load: <stage> <seconds>s [(cached)]`) and "start -> load", the seconds
from process start to the load's first line (Python imports, the app, uvicorn).

The cache goes to a fresh temporary folder (or `--cache-dir`), passed as SWITCHYARD_CACHE_DIR,
and torch.compile's cache beside it (TORCHINDUCTOR_CACHE_DIR): a tree from before the startup
cache ignores the first and still measures the second.

    .venv/bin/python -m bench.startup [--warm 2] [--threads 2] [--avx2] [--tree PATH] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import facts_line, machine_facts

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_STAGE = re.compile(r"^(\S+ \S+) .*?load: ([a-z -]+?) ([0-9.]+)s( \(cached\))?$")
_LOADING = re.compile(r"^(\S+ \S+) .*: loading ")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--warm", type=int, default=2, help="warm starts after the cold one")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default=None, help="--dtype for serve (default: its own)")
    parser.add_argument("--avx2", action="store_true", help="cap torch and oneDNN to AVX2")
    parser.add_argument("--tree", type=Path, default=ROOT, help="source tree to serve from")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="startup cache to use (default: a fresh temporary one: cold)")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parser.parse_args()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_once(args: argparse.Namespace, cache_dir: Path, log_file: Path) -> dict[str, Any]:
    """One start to /health 200; its total seconds and the stages it logged."""
    port = _free_port()
    env = {**os.environ, "SWITCHYARD_CACHE_DIR": str(cache_dir),
           "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "inductor"),
           "SWITCHYARD_KV_CACHE_MEMORY": "256MiB", "PYTHONPATH": str(args.tree),
           **(AVX2_ENV if args.avx2 else {})}
    command = [sys.executable, "-m", "gateway.cli", "serve", "--model-id", "default",
               "--port", str(port), "--num-threads", str(args.threads),
               "--max-total-tokens", "2048"]
    if args.dtype:
        command += ["--dtype", args.dtype]
    with open(log_file, "w") as log:
        started = time.time()
        process = subprocess.Popen(command, cwd=args.tree, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        try:
            ready = _wait_ready(port, process, args.timeout) - started
            dtype = httpx.get(f"http://127.0.0.1:{port}/info", timeout=10).json().get("dtype")
        finally:
            process.terminate()
            process.wait(timeout=60)
    return {"to_health_200_s": round(ready, 2), "dtype": dtype,
            **_parse_log(log_file.read_text(), started)}


def _wait_ready(port: int, process: subprocess.Popen, timeout_s: float) -> float:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"serve exited with {process.returncode}; see its log")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.time()
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise SystemExit(f"serve not ready after {timeout_s:.0f}s")


def _parse_log(text: str, started: float) -> dict[str, Any]:
    stages: dict[str, dict[str, Any]] = {}
    start_to_load = None
    for line in text.splitlines():
        loading = _LOADING.match(line)
        if loading and start_to_load is None:
            start_to_load = round(_epoch(loading.group(1)) - started, 2)
        stage = _STAGE.match(line)
        if stage:
            stages[stage.group(2)] = {"s": float(stage.group(3)), "cached": bool(stage.group(4))}
    return {"start_to_load_s": start_to_load, "stages": stages}


def _epoch(asctime: str) -> float:
    return datetime.strptime(asctime, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _line(label: str, run: dict[str, Any]) -> str:
    stages = ", ".join(f"{name} {s['s']:.2f}s{' (cached)' if s['cached'] else ''}"
                       for name, s in run["stages"].items())
    return (f"{label:>6}: /health 200 after {run['to_health_200_s']:6.2f}s | start -> load "
            f"{run['start_to_load_s']}s | {stages}")


def main() -> None:
    args = parse_args()
    os.environ.update(AVX2_ENV if args.avx2 else {})
    facts = machine_facts(args.dtype or "auto", args.threads)
    print(facts_line(facts), flush=True)
    with tempfile.TemporaryDirectory(prefix="switchyard-startup-") as tmp:
        cache_dir = args.cache_dir or Path(tmp) / "cache"
        runs = []
        for i in range(1 + args.warm):
            run = start_once(args, cache_dir, Path(tmp) / f"serve-{i}.log")
            runs.append(run)
            print(_line("cold" if i == 0 and args.cache_dir is None else "warm", run),
                  flush=True)
    facts["dtype"] = runs[0]["dtype"] or facts["dtype"]
    if args.json:
        args.json.write_text(json.dumps({"machine": facts, "tree": str(args.tree),
                                         "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
