"""The default model over HTTP: batch-1 decode speed and the TTFT of a 600-token prompt.

Starts `switchyard serve --model-id default` from one or more source trees (so a checkout of
an older commit can be measured side by side with this one, in one run), optionally with the
CPU capped to AVX2 (`ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`), and measures
through one streaming client:

- TTFT: a ~600-token prompt, `max_tokens` 1, first content chunk minus send (p50 of repeats);
- batch-1 decode: a short prompt, 128 new tokens with EOS ignored, (end - first chunk) /
  (tokens - 1), as vLLM's TPOT; reported as tokens/s.

    .venv/bin/python -m bench.default_model [--tree PATH ...] [--avx2] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import facts_line, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT_WORDS = 600  # ~600 tokens with SmolLM2's tokenizer (about one token a word here)
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=None,
                        help="source tree to serve from (repeatable; default: this one)")
    parser.add_argument("--avx2", action="store_true", help="cap torch and oneDNN to AVX2")
    parser.add_argument("--dtype", default=None, help="--dtype for serve (default: its own)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(tree: Path, port: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": str(args.threads)}
    if args.avx2:
        env.update(AVX2_ENV)
    cmd = [sys.executable, "-c", "from gateway.cli import main; main()", "serve",
           "--model-id", "default", "--port", str(port), "--num-threads", str(args.threads)]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    return subprocess.Popen(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float = 600) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return httpx.get(f"{url}/info", timeout=5).json()
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server not ready in time")


def stream_times(url: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """Send time, the arrival time of every chunk carrying a choice, and the completion
    tokens (from the usage chunk) of one streamed completion."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    arrivals: list[float] = []
    tokens = 0
    sent = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return sent, arrivals, tokens


def measure(url: str, args: argparse.Namespace) -> dict[str, float]:
    long_prompt = " ".join(f"word{i % 97}" for i in range(PROMPT_WORDS // 2))
    stream_times(url, "Warm up.", 4)
    ttfts = []
    for i in range(args.repeats):
        sent, arrivals, _ = stream_times(url, f"{i} {long_prompt}", 1)
        ttfts.append(arrivals[0] - sent)
    rates = []
    for i in range(max(1, args.repeats // 2)):
        _, arrivals, tokens = stream_times(url, f"Once upon a time, {i}", args.new_tokens)
        # TPOT as vLLM defines it: (end - first token) / (tokens - 1)
        rates.append((tokens - 1) / (arrivals[-1] - arrivals[0]))
    return {"ttft_600_p50_s": statistics.median(ttfts), "decode_b1_tok_s": statistics.median(rates)}


def prompt_tokens(url: str) -> int:
    long_prompt = " ".join(f"word{i % 97}" for i in range(PROMPT_WORDS // 2))
    body = {"model": "default", "prompt": f"0 {long_prompt}", "max_tokens": 1}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["usage"][
        "prompt_tokens"]


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, object]:
    port = free_port()
    proc = start_server(tree, port, args)
    url = f"http://127.0.0.1:{port}"
    try:
        info = wait_ready(url, proc)
        figures = measure(url, args)
        figures["prompt_tokens"] = prompt_tokens(url)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"tree": str(tree), "dtype": info.get("model_dtype"),
            "dtype_reason": info.get("dtype_reason"), **figures}


def main() -> None:
    args = parse_args()
    trees = [Path(t).resolve() for t in (args.tree or [str(ROOT)])]
    facts = machine_facts_for(args)
    print(facts_line(facts))
    results = [run_tree(tree, args) for tree in trees]
    for r in results:
        print(f"{r['tree']}: dtype {r['dtype']}, TTFT({r['prompt_tokens']} tokens) "
              f"{r['ttft_600_p50_s'] * 1000:.0f} ms, batch-1 decode {r['decode_b1_tok_s']:.1f} "
              f"tok/s")
    write_json(str(args.json) if args.json else None, facts, {"trees": results})


def machine_facts_for(args: argparse.Namespace) -> dict[str, object]:
    """bench.common.machine_facts, gathered in a child with the servers' environment (the
    caps act only when set before torch loads)."""
    env = {**os.environ, **(AVX2_ENV if args.avx2 else {})}
    probe = ("import json; from bench.common import machine_facts; "
             f"print(json.dumps(machine_facts({args.dtype or 'auto'!r}, {args.threads})))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env, capture_output=True,
                         text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
