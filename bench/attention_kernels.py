"""Our C++ attention kernels against what they replace, in one process, alternating:

- decode rows (`switchyard_cpu::paged_decode_attention`) against the torch.compile'd
  reductions (`attention._decode_fused`), B sequences over ~`--context` cached tokens each,
  once with each sequence's blocks in a row (as a fresh server hands out a prompt's blocks) and
  once scattered through the cache (as a long-running one leaves them); `--layers` caches are
  read in turn, as a step reads its layers', so that K/V come from memory and not from the
  last-level cache (a single layer's fits there, and flattered burst prefetching); a plain read
  of the same K/V (two sums) is printed beside them as the memory floor;
- a prompt chunk (`switchyard_cpu::paged_prefill_attention`) against torch's SDPA (causal,
  the CPU flash kernel) at several lengths.

W1's attention shape by default (12 heads of 64, no GQA); bf16 where the CPU has native bf16,
else float32. Prints the median ms of each and the ratio ours / torch.

    .venv/bin/python -m bench.attention_kernels [--threads 2] [--batch 16 64] [--context 160]
        [--layers 12] [--prompts 19 128 512 2048] [--heads 12] [--kv-heads 12] [--head-dim 64]
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

from bench.common import configure_threads, facts_line, machine_facts, resolve_bench_dtype  # noqa: E402

BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--layers", type=int, default=12,
                        help="caches read in turn (decode), so that K/V come from memory")
    parser.add_argument("--prompts", type=int, nargs="+", default=[19, 128, 512, 2048])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9)
    return parser.parse_args()


def alternate(fns: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median ms a call of each, timed in alternating rounds."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def decode_case(args: argparse.Namespace, batch: int, dtype, scattered: bool,
                ) -> dict[str, float]:
    """Median ms a layer, each of `--layers` caches read in turn."""
    import torch

    from backends.native.layers.attention import _decode_fused, decode_mask

    gen = torch.Generator().manual_seed(batch)
    width = -(-args.context // BLOCK_SIZE)
    blocks = batch * width + 16
    shape = (blocks, args.kv_heads, BLOCK_SIZE, args.head_dim)
    caches = [tuple(torch.randn(shape, generator=gen).to(dtype) for _ in "kv")
              for _ in range(args.layers)]
    q = torch.randn(batch, args.heads, args.head_dim, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen) if scattered else torch.arange(blocks)
    tables = order[: batch * width].view(batch, width)
    ends = torch.full((batch,), args.context)
    mask = decode_mask(torch.zeros(batch, dtype=torch.long), ends, width * BLOCK_SIZE)
    scale = args.head_dim ** -0.5
    compiled = torch.compile(_decode_fused, dynamic=True)
    ours = torch.ops.switchyard_cpu.paged_decode_attention
    ms = alternate({
        "ours": lambda: [ours(q, k, v, tables, mask, scale) for k, v in caches],
        "torch": lambda: [compiled(q, k, v, tables, mask, scale) for k, v in caches],
        "read K+V": lambda: [(k.sum(), v.sum()) for k, v in caches],
    }, args.rounds, 3)
    return {name: value / args.layers for name, value in ms.items()}


def prefill_case(args: argparse.Namespace, length: int, dtype) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(length)
    width = -(-length // BLOCK_SIZE)
    shape = (width, args.kv_heads, BLOCK_SIZE, args.head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(length, args.heads, args.head_dim, generator=gen).to(dtype)
    table = torch.arange(width)
    keys = k_cache.transpose(0, 1).reshape(args.kv_heads, -1, args.head_dim)[:, :length]
    values = v_cache.transpose(0, 1).reshape(args.kv_heads, -1, args.head_dim)[:, :length]
    scale = args.head_dim ** -0.5
    calls = max(1, 2000 // length)
    return alternate({
        "ours": lambda: torch.ops.switchyard_cpu.paged_prefill_attention(
            q, k_cache, v_cache, table, length, 0, scale),
        "torch": lambda: F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=True),
    }, args.rounds, calls)


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, False)
    import torch

    from backends.cpu_kernels.build import active_variant

    dtype_name = resolve_bench_dtype("auto")
    dtype = getattr(torch, dtype_name)
    print(facts_line(machine_facts(dtype_name, args.threads)), "|", placement)
    variant = active_variant()
    if variant is None:
        sys.exit("our C++ kernels are not built for this CPU (or SWITCHYARD_CPU_KERNELS=off)")
    print(f"kernels: {variant}; {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}")
    with torch.inference_mode():
        for batch in args.batch:
            for scattered in (False, True):
                ms = decode_case(args, batch, dtype, scattered)
                print(f"decode {batch:3d} x {args.context} tokens, blocks "
                      f"{'scattered' if scattered else 'in a row '}: ours {ms['ours']:.3f} ms | "
                      f"torch.compile {ms['torch']:.3f} | ours/torch "
                      f"{ms['ours'] / ms['torch']:.2f} | read K+V {ms['read K+V']:.3f}")
        for length in args.prompts:
            ms = prefill_case(args, length, dtype)
            print(f"prompt {length:5d} tokens: ours {ms['ours']:.3f} ms | SDPA {ms['torch']:.3f}"
                  f" | ours/torch {ms['ours'] / ms['torch']:.2f}")


if __name__ == "__main__":
    main()
