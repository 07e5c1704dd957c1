"""Dense linears on CPU: `F.linear` vs oneDNN with the weight prepacked once, side by side.

W1's shapes (768 hidden, 2048 intermediate, 32000 vocab; q/k/v and gate/up fused) at decode
and prefill row counts, in the engine's dtype for this machine (`--dtype auto`) or another.
Prints GFLOP/s of both and their ratio, and whether the outputs are bit-identical.

    .venv/bin/python -m bench.linear_kernels [--threads 2] [--dtype auto] [--rows 1 16 64 256]

`--gguf`: GGUF k-quant weights at a ~1.5B model's shapes instead (N x K: 8960 x 1536 gate /
up, 1536 x 8960 down, 2048 x 2048), random valid blocks: our kernel on the blocks repacked at
load (`packed`, KQuantLinear's kernel path) and on the file's blocks as stored (`blocks`, the
kernel before the repacking; for Q4_K also the int4 conversion, Int4Linear) against
dequantizing at each call + matmul and against a dense weight kept in the dtype (the memory
the packed forms save), in ms per call.

    .venv/bin/python -m bench.linear_kernels --gguf [--rows 1 16 64] [--types Q4_K Q5_K Q6_K]
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
    parser.add_argument("--gguf", action="store_true", help="GGUF k-quant kernels instead")
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q5_0", "Q5_K", "Q6_K"])
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


GGUF_SHAPES = {"gate_up": (8960, 1536), "down": (1536, 8960), "square": (2048, 2048)}


def measure_gguf(qtype: str, n: int, k: int, rows: int, dtype: str,
                 repeats: int) -> dict[str, float]:
    """ms per call of each path for one weight, and its packed / dense MB."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from backends.quantized.gguf import GGUFRaw, affine
    from backends.quantized.int4_linear import Int4Linear
    from tests.quantized.gguf_files import blocks

    kind = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).normal(0, 0.05, (n, k)).astype(np.float32)
    data = torch.from_numpy(blocks(values, kind, np.random.default_rng(1)))
    torch_dtype = getattr(torch, dtype)
    x = torch.randn(rows, k, dtype=torch_dtype)
    weight = torch.ops.switchyard_cpu.kquant_dequantize(data, int(kind), k, torch_dtype)
    packed = torch.ops.switchyard_cpu.kquant_pack(data, int(kind), k)
    paths = {
        "packed": lambda: torch.ops.switchyard_cpu.kquant_packed_mm(x, packed, int(kind), k),
        "blocks": lambda: torch.ops.switchyard_cpu.kquant_mm(x, data, int(kind), k),
        "dequant+mm": lambda: x @ torch.ops.switchyard_cpu.kquant_dequantize(
            data, int(kind), k, torch_dtype).t(),
        "dense": lambda: torch.nn.functional.linear(x, weight),
    }
    if kind == GGMLQuantizationType.Q4_K:
        int4 = Int4Linear(affine(GGUFRaw("w", kind, data, k)), None, torch.device("cpu"),
                          torch_dtype)
        paths["int4"] = lambda: int4(x)
    with torch.inference_mode():
        got = {name: best_ms(fn, repeats, calls=5) for name, fn in paths.items()}
    return {**got, "file_mb": data.numel() / 1e6, "packed_mb": packed.numel() / 1e6,
            "dense_mb": weight.nbytes / 1e6}


def main_gguf(args: argparse.Namespace, dtype: str, facts: dict) -> None:
    from backends.cpu_kernels.build import kernel_status

    print("cpu kernels:", kernel_status().describe())
    print(f"{'type':5s} {'weight':8s} {'N x K':>12s} {'rows':>5s} {'packed':>8s} {'blocks':>8s}"
          f" {'int4':>8s} {'deq+mm':>8s} {'dense':>8s}  (ms)  MB file / packed / dense")
    results = {}
    for qtype in args.types:
        for name, (n, k) in GGUF_SHAPES.items():
            for rows in args.rows:
                got = measure_gguf(qtype, n, k, rows, dtype, args.repeats)
                results[f"{qtype}/{name}/{rows}"] = got
                int4 = f"{got['int4']:8.2f}" if "int4" in got else f"{'':8s}"
                print(f"{qtype:5s} {name:8s} {f'{n} x {k}':>12s} {rows:5d} {got['packed']:8.2f}"
                      f" {got['blocks']:8.2f} {int4} {got['dequant+mm']:8.2f} {got['dense']:8.2f}"
                      f"       {got['file_mb']:.1f} / {got['packed_mb']:.1f} / "
                      f"{got['dense_mb']:.1f}")
    write_json(args.json, facts, results)


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, args.bind)
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts), "|", placement)
    if args.gguf:
        main_gguf(args, dtype, facts)
        return
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
