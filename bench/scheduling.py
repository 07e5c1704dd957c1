"""What the scheduler's two levers buy, each as an A/B in one run on W1's random ~125M Llama
(an engine with the lever off, then one with it on, in the same process and machine minute):

- shared-prefix: 64 requests sharing a 512-token system prompt plus a unique 64-token
  suffix, 32 new tokens each: TTFT p50/p99 and output throughput, prefix cache on vs off.
- mixed: 16 streams decoding while 1,500-token prompts keep arriving: inter-token
  latency p50/p99 of the 16 streams, chunked prefill on vs off.

The engine is driven in-process; a token's time is the end of the step that made it
(what a client sees, less the HTTP hop). Usage: python -m bench.scheduling [--only X]
[--dtype auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
    write_random_llama,
)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _engine(folder: Path, threads: int, dtype: str, **options: Any):
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    config = EngineConfig(model=str(folder), dtype=dtype, max_total_tokens=2048,
                          max_batch_size=64, num_threads=threads, **options)
    engine = LLMEngine(config)
    warm = [list(range(10, 90))] * 2
    engine.generate(warm, _greedy(4))
    return engine


def _greedy(tokens: int):
    from backends.base import SamplingParams

    return SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)


def _run(engine, arrivals: list[tuple[float, str, list[int], int]]) -> dict[str, list[float]]:
    """Feed (arrival offset, id, prompt, new tokens) in time; token times per request."""
    pending = sorted(arrivals)
    times: dict[str, list[float]] = {rid: [] for _, rid, _, _ in arrivals}
    sent: dict[str, float] = {}
    start = time.perf_counter()
    while pending or engine.has_work():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, rid, prompt, new = pending.pop(0)
            engine.add_request(rid, prompt, _greedy(new))
            sent[rid] = time.perf_counter()
        if not engine.has_work():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        for out in outputs:
            if out.tokens:
                times[out.request_id].append(stamp - sent[out.request_id])
    return times


def shared_prefix(folder: Path, threads: int, dtype: str) -> dict[str, dict[str, float]]:
    system = random_prompts(1, 512, 32000, seed=1)[0]
    suffixes = random_prompts(64, 64, 32000, seed=2)
    arrivals = [(0.0, f"p{i}", system + s, 32) for i, s in enumerate(suffixes)]
    print("shared-prefix: 64 x (512 shared + 64 unique) prompt tokens, 32 new tokens")
    figures: dict[str, dict[str, float]] = {}
    for caching in (False, True):
        engine = _engine(folder, threads, dtype, prefix_caching=caching)
        start = time.perf_counter()
        times = _run(engine, arrivals)
        wall = time.perf_counter() - start
        ttft = [t[0] for t in times.values()]
        tokens = sum(len(t) for t in times.values())
        print(f"  prefix cache {'on ' if caching else 'off'}: TTFT p50 {_percentile(ttft, .5):6.2f}"
              f" s  p99 {_percentile(ttft, .99):6.2f} s   throughput {tokens / wall:7.1f} tok/s"
              f"   cache hits {engine.block_manager.hits}/{engine.block_manager.queries}")
        figures[f"prefix_cache_{'on' if caching else 'off'}"] = {
            "ttft_p50_s": _percentile(ttft, .5), "ttft_p99_s": _percentile(ttft, .99),
            "output_tokens_per_s": tokens / wall}
        del engine
    return figures


def mixed(
    folder: Path, threads: int, dtype: str, long_prompts: int, interval: float,
) -> dict[str, dict[str, float]]:
    streams = random_prompts(16, 64, 32000, seed=3)
    longs = random_prompts(long_prompts, 1500, 32000, seed=4)
    arrivals = [(0.0, f"s{i}", p, 96) for i, p in enumerate(streams)]
    arrivals += [(0.5 + i * interval, f"l{i}", p, 4) for i, p in enumerate(longs)]
    print(f"mixed: 16 streams x 96 new tokens; a 1,500-token prompt every {interval}s "
          f"({long_prompts} in all)")
    figures: dict[str, dict[str, float]] = {}
    for chunked in (False, True):
        engine = _engine(folder, threads, dtype, chunked_prefill=chunked, max_batch_prefill_tokens=(
            512 if chunked else 2048), prefix_caching=False)
        times = _run(engine, arrivals)
        gaps = [b - a for rid, t in times.items() if rid.startswith("s")
                for a, b in zip(t, t[1:], strict=False)]
        print(f"  chunked prefill {'on ' if chunked else 'off'}: ITL p50 "
              f"{statistics.median(gaps) * 1000:7.1f} ms  p99 {_percentile(gaps, .99) * 1000:7.1f}"
              f" ms  max {max(gaps) * 1000:7.1f} ms")
        figures[f"chunked_prefill_{'on' if chunked else 'off'}"] = {
            "itl_p50_s": statistics.median(gaps), "itl_p99_s": _percentile(gaps, .99),
            "itl_max_s": max(gaps)}
        del engine
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", choices=["shared-prefix", "mixed"])
    parser.add_argument("--long-prompts", type=int, default=6)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"),
                        default="auto", help="engine dtype (auto: the engine's choice here)")
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    args = parser.parse_args()
    configure_threads(args.threads, bind=False)
    facts = machine_facts(resolve_bench_dtype(args.dtype), args.threads)
    print(facts_line(facts))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_random_llama(Path(tmp) / "llama")
        if args.only in (None, "shared-prefix"):
            results["shared_prefix"] = shared_prefix(folder, args.threads, args.dtype)
        if args.only in (None, "mixed"):
            results["mixed"] = mixed(folder, args.threads, args.dtype, args.long_prompts,
                                     args.interval)
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
