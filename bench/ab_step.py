"""A/B of engine settings on a shared, noisy machine: two engines in one process, timed in
alternating rounds, so that whatever else runs slows both alike.

Engine A takes `--a FIELD=VALUE` EngineConfig overrides, engine B `--b ...` (either may be
empty: the defaults). Per batch size both hold B sequences decoding; each round times
`--steps` decode steps of one engine, then of the other (the order flips every round). Prints
each engine's median and best ms/step and the median of the per-round ratios B/A.

    .venv/bin/python -m bench.ab_step --model default --batch 1 16 \
        --a compile_decode_step=true --b compile_decode_step=false [--rounds 8] [--json out]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    configure_threads,
    facts_line,
    machine_facts,
    resolve_bench_dtype,
    write_json,
    write_random_llama,
)
from bench.profile_step import (  # noqa: E402
    build_engine,
    engine_overrides,
    finish_all,
    start_batch,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--model", default=None, help="a model the engine loads (default: W1's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--a", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--b", action="append", default=[], metavar="FIELD=VALUE")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def timed_steps(engine: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def compare(engines: dict[str, Any], batch: int, args: argparse.Namespace) -> dict[str, Any]:
    for name, engine in engines.items():
        start_batch(engine, batch, args.prompt_len, f"{name}{batch}")
    times: dict[str, list[float]] = {name: [] for name in engines}
    for round_index in range(args.rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            times[name].append(timed_steps(engines[name], args.steps))
    for name, engine in engines.items():
        finish_all(engine, f"{name}{batch}", batch)
    ratios = [b / a for a, b in zip(times["A"], times["B"], strict=True)]
    return {
        "ms_per_step": {n: {"median": statistics.median(t), "best": min(t), "rounds": t}
                        for n, t in times.items()},
        "ratio_b_over_a": statistics.median(ratios),
    }


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, args.bind)
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts), "|", placement)
    print(f"A: {' '.join(args.a) or 'defaults'} | B: {' '.join(args.b) or 'defaults'}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_llama(Path(tmp) / "w1"))
        engines = {name: build_engine(model, dtype, max(args.batch), engine_overrides(pairs))
                   for name, pairs in (("A", args.a), ("B", args.b))}
        results: dict[str, Any] = {}
        for batch in args.batch:
            result = compare(engines, batch, args)
            ms = result["ms_per_step"]
            print(f"batch {batch}: A {ms['A']['median']:.1f} ms/step (best {ms['A']['best']:.1f})"
                  f" | B {ms['B']['median']:.1f} (best {ms['B']['best']:.1f})"
                  f" | B/A {result['ratio_b_over_a']:.2f}")
            results[str(batch)] = result
    write_json(args.json, facts, {"a": args.a, "b": args.b, "batches": results})


if __name__ == "__main__":
    main()
