"""Prepacked oneDNN linears: memory and time with row counts bucketed vs exact.

oneDNN builds and keeps one primitive per row count it meets. A stream of prefill-like
row counts (random, 1 to --max-rows, fixed seed) goes through the default model's four
linear shapes, each arm in a fresh process: `exact` (every row count as it comes) and
`bucketed` (what the engine does: `cpu_linear.row_bucket`). Prints per arm the RSS the
stream added, the distinct row counts oneDNN saw, and the time of a first pass (primitives
built on the way) and of a second pass over the same stream (all of them cached: what
padding costs), with the ratios bucketed / exact.

    .venv/bin/python -m bench.linear_memory [--calls 400] [--max-rows 2048] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import facts_line, machine_facts, resolve_bench_dtype, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# SmolLM2-135M: q/k/v fused, o, gate/up fused, down (in, out)
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}

ARM = """
import json, random, sys, time
import torch
from backends.native.layers import cpu_linear
from backends.native.layers.cpu_linear import PrepackedLinear
arm, dtype, calls, max_rows, threads, shapes = sys.argv[1:7]
torch.set_num_threads(int(threads))
if arm == "exact":
    cpu_linear.row_bucket = lambda rows: rows
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1])
dtype = getattr(torch, dtype)
layers = [PrepackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype))
          for k, n in json.loads(shapes).values()]
rng = random.Random(0)
stream = [rng.randint(1, int(max_rows)) for _ in range(int(calls))]
inputs = {k: torch.randn(int(max_rows), k, dtype=dtype) for k in {l.in_features for l in layers}}
def one_pass():
    start = time.perf_counter()
    for rows in stream:
        for layer in layers:
            layer(inputs[layer.in_features][:rows])
    return time.perf_counter() - start
with torch.inference_mode():
    for layer in layers:
        layer(inputs[layer.in_features][:1])
    before = rss()
    first = one_pass()
    grown = (rss() - before) / 1024
    second = one_pass()
seen = len({cpu_linear.row_bucket(rows) for rows in stream})
print(json.dumps({"rss_mib": grown, "row_counts": seen, "first_s": first, "second_s": second}))
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=400, help="row counts in the stream")
    parser.add_argument("--max-rows", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def run_arm(arm: str, dtype: str, args: argparse.Namespace) -> dict[str, float]:
    argv = [sys.executable, "-c", ARM, arm, dtype, str(args.calls), str(args.max_rows),
            str(args.threads), json.dumps(SHAPES)]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts))
    results = {arm: run_arm(arm, dtype, args) for arm in ("exact", "bucketed")}
    print(f"{'arm':9s} {'RSS added':>10s} {'row counts':>10s} {'1st pass':>9s} {'2nd pass':>9s}")
    for arm, got in results.items():
        print(f"{arm:9s} {got['rss_mib']:8.0f} MiB {got['row_counts']:10d} "
              f"{got['first_s']:8.2f}s {got['second_s']:8.2f}s")
    exact, bucketed = results["exact"], results["bucketed"]
    print(f"bucketed / exact: RSS {bucketed['rss_mib'] / max(exact['rss_mib'], 1):.2f}x, "
          f"first pass {bucketed['first_s'] / exact['first_s']:.2f}x, "
          f"second pass {bucketed['second_s'] / exact['second_s']:.2f}x")
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
