"""One MoE block: the Python block over our bf16 kernel operators against one C++ call
(switchyard_cpu::bf16_moe_block), side by side in one process.

One SparseMoeBlock at Qwen3-MoE's shape in bench/moe.py (hidden 1024, 64 experts of 512, top
8), random bf16 weights, prepacked for our bf16 kernel (AVX-512-BF16 CPUs only). Each call
takes the next of 64 random inputs, so the experts chosen vary as in a model (192 MB of
weights, more than the caches hold). Rounds alternate the two paths; a round is `--calls`
calls, and the table gives the median round's µs per call of the whole block (the router's
matmul, softmax and top-k, grouping, the experts, weighting and summing) each way, and
Python / C++.

    .venv/bin/python -m bench.moe_block [--threads 2] [--rows 1,16] [--rounds 9] [--calls 100]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import configure_threads, facts_line, machine_facts, write_json  # noqa: E402

HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE = 1024, 64, 8, 512
INPUTS = 64


def _block() -> Any:
    import torch
    from torch import nn

    from backends.native.layers.cpu_linear import prepack_linears
    from backends.native.models.moe import SparseMoeBlock

    torch.manual_seed(0)
    block = SparseMoeBlock(HIDDEN, EXPERTS, TOP_K, EXPERT_SIZE, renormalize=True)
    with torch.no_grad():
        for parameter in block.parameters():
            nn.init.normal_(parameter, std=HIDDEN ** -0.5)
    block = block.to(torch.bfloat16).eval()
    prepack_linears(block, bf16_kernel=True)
    if not block.uses_fused_experts():
        raise SystemExit("the experts are not on our bf16 kernel (no AVX-512-BF16?)")
    return block


def _per_call_us(call: Callable[[int], Any], calls: int) -> float:
    start = time.perf_counter()
    for i in range(calls):
        call(i)
    return (time.perf_counter() - start) / calls * 1e6


def _measure(block: Any, rows: int, rounds: int, calls: int) -> dict[str, float]:
    """Median µs per call of the block on each path, rounds alternating."""
    import torch

    generator = torch.Generator().manual_seed(rows)
    inputs = [torch.randn(rows, HIDDEN, generator=generator).bfloat16() for _ in range(INPUTS)]
    fused = block.fused
    paths = {"python": None, "cpp": fused}
    times: dict[str, list[float]] = {path: [] for path in paths}

    def call(i: int) -> Any:
        return block.route_and_run(inputs[i % INPUTS])
    with torch.no_grad():
        for x in inputs[:4]:  # same output both ways, and warm
            block.fused = None
            want = block.route_and_run(x)
            block.fused = fused
            assert torch.equal(block.route_and_run(x), want)
        for _ in range(rounds):
            for path, setting in paths.items():
                block.fused = setting
                call(0)
                times[path].append(_per_call_us(call, calls))
    block.fused = fused
    return {path: statistics.median(values) for path, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true", help="pin thread i to core i")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--json")
    args = parser.parse_args()
    threading = configure_threads(args.threads, args.bind)
    facts = machine_facts("bfloat16", args.threads)
    print(facts_line(facts) + f" ({threading})")
    block = _block()
    results: dict[str, Any] = {}
    print("\n| rows | Python block µs | C++ µs | Python / C++ |\n|---:|---:|---:|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        measured = _measure(block, rows, args.rounds, args.calls)
        results[str(rows)] = measured
        python, cpp = measured["python"], measured["cpp"]
        print(f"| {rows} | {python:.0f} | {cpp:.0f} | {python / cpp:.2f} |")
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
