"""The default model's Q8_0 lm_head (49152 x 576, tied to token_embd): our 8-bit kernel
(`Q8Linear`, AVX2 or AVX-512 VNNI) against the two int4 halves `q4_mm` runs otherwise,
alternating in one process, with the weight read from memory each call (a 64 MB buffer is
written between calls). Prints the median ms of each, their ratio, and each one's max error
against the float64 product.

    .venv/bin/python -m bench.q8_lm_head [--threads 2] [--rows 1 16 64] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import configure_threads, facts_line, machine_facts, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def cold_median_ms(fn: Callable[[], object], flush: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        flush()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    args = parse_args()
    configure_threads(args.threads, False)
    import torch

    from backends.default_model import default_model_path
    from backends.native.loading.gguf_reader import open_gguf, raw_tensor
    from backends.quantized import q8_linear
    from backends.quantized.gguf import affine, q8_0_values
    from backends.quantized.int4_linear import Int4Linear

    print(facts_line(machine_facts("float32", args.threads)))
    cpu = torch.device("cpu")
    if not q8_linear.available(cpu, torch.float32):
        sys.exit("the Q8_0 kernel runs only where our kernels run (AVX2 or AVX-512 VNNI)")
    reader = open_gguf(default_model_path())
    raw = raw_tensor(next(t for t in reader.tensors if t.name == "token_embd.weight"))
    q, scale = q8_0_values(raw)
    q8 = q8_linear.Q8Linear(q, scale, None, cpu, torch.float32)
    halves = Int4Linear(affine(raw), None, cpu, torch.float32)
    weight = raw.dense().double()
    scratch = torch.zeros(16 * 1024 * 1024)
    results = []
    for rows in args.rows:
        x = torch.randn(rows, q.shape[1], generator=torch.Generator().manual_seed(rows))
        want = x.double() @ weight.t()
        row = {"rows": rows}
        for name, module in (("halves", halves), ("q8", q8)):
            row[f"{name}_error"] = (module(x).double() - want).abs().max().item()
        timed = {"halves": [], "q8": []}
        for _ in range(3):  # alternate: the machine's speed drifts
            for name, module in (("halves", halves), ("q8", q8)):
                flush = lambda: scratch.add_(1)  # noqa: E731
                timed[name].append(cold_median_ms(lambda m=module, x=x: m(x), flush,
                                                  args.rounds // 3))
        row.update({f"{name}_ms": statistics.median(v) for name, v in timed.items()})
        print(f"rows {rows:3d}: halves {row['halves_ms']:.2f} ms | q8 {row['q8_ms']:.2f} ms | "
              f"q8/halves {row['q8_ms'] / row['halves_ms']:.2f} | max error vs float64: "
              f"halves {row['halves_error']:.1e}, q8 {row['q8_error']:.1e}")
        results.append(row)
    write_json(args.json, machine_facts("float32", args.threads), {"lm_head": results})


if __name__ == "__main__":
    main()
