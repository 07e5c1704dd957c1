"""How close the dense linears run to this CPU's limits: peaks measured, then oneDNN against them.

Measures, on this machine and in this run (best of `--repeats`; a shared machine only ever
makes a probe slower):

- the multiply-add peaks: float32 FMA and, where the CPU has AVX-512-BF16, `vdpbf16ps` (two
  bf16 products a float32 lane), with 1 thread and with `--threads`;
- a read stream over 1 GiB with `--threads` (what weights and the KV cache can be read at);
- W1's prepacked linears (the engine's `PrepackedLinear`: oneDNN, and where the engine takes
  it our kernel: `cpu_kernels/bf16_linear.cpp` in bf16 on AVX-512-BF16, `f32_linear.cpp` in
  float32 where our kernels run AVX2 code) at decode and prefill row counts, as GFLOP/s
  and as a share of the peak in the engine's dtype;
- a whole decode step's 49 linears over distinct weights (as in the engine: each weight comes
  from memory, not from cache) at 1, 16 and 64 rows, each kernel in turn, against the floor of
  that step: the larger of its multiply-adds at the peak and its weight bytes at the stream
  rate (the share of the floor reached in brackets).

The probes are `bench/roofline_probe.c`, built with the system's C compiler (`-O3
-march=native -fopenmp`; AVX-512 or AVX2 code as the CPU has).

    .venv/bin/python -m bench.roofline [--threads 2] [--dtype auto] [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    LLAMA_125M,
    configure_threads,
    facts_line,
    machine_facts,
    resolve_bench_dtype,
    write_json,
)
from bench.linear_kernels import SHAPES as KERNEL_SHAPES  # noqa: E402
from bench.linear_kernels import best_ms  # noqa: E402

PROBE_SOURCE = Path(__file__).with_name("roofline_probe.c")
SHAPES = {**KERNEL_SHAPES, "o": (768, 768)}  # W1's weights, the attention output one too
ROWS = (16, 64, 2048)
STEP_ROWS = (1, 16, 64)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the best one counts")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def build_probe(folder: Path) -> Path:
    binary = folder / "roofline_probe"
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", str(PROBE_SOURCE), "-o",
                    str(binary)], check=True, capture_output=True, text=True)
    return binary


def probe(binary: Path, mode: str, threads: int, repeats: int) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    runs = [float(subprocess.run([str(binary), mode], env=env, check=True, capture_output=True,
                                 text=True).stdout) for _ in range(repeats)]
    return max(runs)


def call_linears(linears: Sequence[Callable[[Any], object]], inputs: Sequence[Any]) -> None:
    for linear, x in zip(linears, inputs, strict=True):
        linear(x)


def linear_rates(dtype: str, repeats: int, ours: bool) -> dict[str, dict[int, float]]:
    import torch

    from backends.native.layers.cpu_linear import PrepackedLinear

    torch_dtype = getattr(torch, dtype)
    rates: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name, (k, n) in SHAPES.items():
            packed = PrepackedLinear(torch.nn.Linear(k, n, bias=False).to(torch_dtype),
                                     bf16_kernel=ours, f32_kernel=ours)
            rates[name] = {}
            for rows in ROWS:
                x = torch.randn(rows, k, dtype=torch_dtype)
                seconds = best_ms(partial(packed, x), repeats, calls=5) / 1000
                rates[name][rows] = 2 * rows * k * n / seconds / 1e9
    return rates


def decode_step_linears(dtype: str, repeats: int, kernels: list[str],
                        ) -> tuple[dict[str, dict[int, float]], int, int]:
    """Seconds for one step's linears over distinct weights, per kernel and row count (the
    kernels alternate); flop per row and weight bytes of that step."""
    import torch

    from backends.native.layers.cpu_linear import PrepackedLinear

    layers = LLAMA_125M["num_hidden_layers"]
    shapes = [SHAPES[name] for name in ("qkv", "o", "gate_up", "down")] * layers
    shapes.append(SHAPES["lm_head"])
    torch_dtype = getattr(torch, dtype)
    plain = [torch.nn.Linear(k, n, bias=False).to(torch_dtype) for k, n in shapes]
    linears = {kernel: [PrepackedLinear(linear, kernel == "ours", kernel == "ours")
                        for linear in plain] for kernel in kernels}
    del plain
    seconds: dict[str, dict[int, float]] = {kernel: {} for kernel in kernels}
    with torch.inference_mode():
        for rows in STEP_ROWS:
            inputs = {k: torch.randn(rows, k, dtype=torch_dtype) for k in (768, 2048)}
            step_inputs = [inputs[k] for k, _ in shapes]
            for kernel in kernels:
                seconds[kernel][rows] = best_ms(
                    partial(call_linears, linears[kernel], step_inputs), repeats, calls=1) / 1000
    weight_bytes = sum(k * n for k, n in shapes) * torch_dtype.itemsize
    return seconds, sum(2 * k * n for k, n in shapes), weight_bytes


def measure_peaks(threads: int, repeats: int) -> tuple[dict[str, float], float]:
    with tempfile.TemporaryDirectory() as tmp:
        binary = build_probe(Path(tmp))
        peaks = {f"{mode}_{t}t": probe(binary, mode, t, repeats)
                 for mode in ("fma32", "bf16dot") for t in (1, threads)}
        return peaks, probe(binary, "stream", threads, repeats)


def print_rates(kernel: str, rates: dict[str, dict[int, float]], peak: float) -> None:
    print(f"{kernel:6s} {'K x N':>12s} " + " ".join(f"{r:>5d} rows" for r in ROWS)
          + "   (GFLOP/s, % of peak)")
    for name, (k, n) in SHAPES.items():
        cells = " ".join(f"{rates[name][r]:4.0f} {100 * rates[name][r] / peak:3.0f}%"
                         for r in ROWS)
        print(f"{name:8s} {f'{k} x {n}':>10s} {cells}")


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, bind=False)
    from backends.cpu_kernels.build import active_variant, bf16_linear_built

    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts), "|", placement)
    peaks, stream = measure_peaks(args.threads, args.repeats)
    bf16 = dtype == "bfloat16" and facts["bf16_native"]
    peak = peaks[f"bf16dot_{args.threads}t"] if bf16 else peaks[f"fma32_{args.threads}t"]
    print(f"peaks (GFLOP/s, 1 / {args.threads} threads): float32 FMA {peaks['fma32_1t']:.0f} / "
          f"{peaks[f'fma32_{args.threads}t']:.0f}, bf16 dot {peaks['bf16dot_1t']:.0f} / "
          f"{peaks[f'bf16dot_{args.threads}t']:.0f} (0: no AVX-512-BF16); read stream "
          f"{stream:.1f} GB/s; {dtype} peak used below: {peak:.0f}")
    # "ours": cpu_kernels/bf16_linear.cpp or f32_linear.cpp, where the engine would take it
    ours = (bf16 and bf16_linear_built()) or (dtype == "float32" and active_variant() == "avx2")
    kernels = ["onednn", "ours"] if ours else ["onednn"]
    rates = {kernel: linear_rates(dtype, args.repeats, kernel == "ours") for kernel in kernels}
    for kernel in kernels:
        print_rates(kernel, rates[kernel], peak)
    step, flop_per_row, weight_bytes = decode_step_linears(dtype, args.repeats, kernels)
    floors = {}
    print(f"a decode step's 49 linears, distinct weights ({weight_bytes / 1e6:.0f} MB):")
    for rows in STEP_ROWS:
        compute, read = rows * flop_per_row / peak / 1e9, weight_bytes / stream / 1e9
        floors[rows] = max(compute, read)
        times = ", ".join(f"{kernel} {step[kernel][rows] * 1e3:6.2f} ms "
                          f"({100 * floors[rows] / step[kernel][rows]:.0f}%)" for kernel in kernels)
        print(f"  {rows:3d} rows: {times}; floor {floors[rows] * 1e3:6.2f} ms (multiply-adds at "
              f"peak {compute * 1e3:.2f}, weights at the stream rate {read * 1e3:.2f})")
    write_json(args.json, facts, {"peaks_gflops": peaks, "stream_gbs": stream,
                                  "peak_used": peak, "gflops": rates,
                                  "decode_step_linears_s": step, "floors_s": floors})


if __name__ == "__main__":
    main()
