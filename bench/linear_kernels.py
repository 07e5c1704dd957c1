"""Dense linears on CPU: `F.linear` vs oneDNN with the weight prepacked once, side by side.

W1's shapes (768 hidden, 2048 intermediate, 32000 vocab; q/k/v and gate/up fused) at decode
and prefill row counts, in the engine's dtype for this machine (`--dtype auto`) or another.
Prints GFLOP/s of both and their ratio, and whether the outputs are bit-identical.

    .venv/bin/python -m bench.linear_kernels [--threads 2] [--dtype auto] [--rows 1 16 64 256]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    configure_threads,
    facts_line,
    machine_facts,
    resolve_bench_dtype,
    write_json,
)

SHAPES = {"qkv": (768, 2304), "gate_up": (768, 4096), "down": (2048, 768), "lm_head": (768, 32000)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the best one counts")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def best_ms(fn: Callable[[], object], repeats: int, calls: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1000


def measure(k: int, n: int, rows: int, dtype: str, repeats: int) -> dict[str, float | bool]:
    import torch
    import torch.nn.functional as F

    from backends.native.layers.cpu_linear import PrepackedLinear

    linear = torch.nn.Linear(k, n, bias=False).to(getattr(torch, dtype))
    packed = PrepackedLinear(linear)
    x = torch.randn(rows, k, dtype=linear.weight.dtype)
    with torch.inference_mode():
        plain_ms = best_ms(lambda: F.linear(x, linear.weight), repeats)
        packed_ms = best_ms(lambda: packed(x), repeats)
        identical = bool(torch.equal(F.linear(x, linear.weight), packed(x)))
    flop = 2 * rows * k * n / 1e9
    return {"linear_gflops": flop / plain_ms * 1000, "prepacked_gflops": flop / packed_ms * 1000,
            "speedup": plain_ms / packed_ms, "bit_identical": identical}


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, args.bind)
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts), "|", placement)
    print(f"{'weight':8s} {'K x N':>12s} {'rows':>5s} {'F.linear':>9s} {'prepacked':>9s}"
          f" {'ratio':>6s}  identical")
    results = {}
    for name, (k, n) in SHAPES.items():
        for rows in args.rows:
            got = measure(k, n, rows, dtype, args.repeats)
            results[f"{name}/{rows}"] = got
            print(f"{name:8s} {f'{k} x {n}':>12s} {rows:5d} {got['linear_gflops']:9.0f}"
                  f" {got['prepacked_gflops']:9.0f} {got['speedup']:5.2f}x  {got['bit_identical']}")
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
