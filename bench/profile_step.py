"""Where a decode step's time goes, in process: the engine's phases and torch's operators.

Runs W1's random Llama (or `--model`, e.g. `default`) with B sequences decoding together and
times `--steps` decode steps after warm-up, two ways:

- phases (perf_counter around the engine's own calls): schedule, prepare (step tensors),
  forward, sample, append (detokenize, stops, outputs), other;
- operators (torch profiler over the same steps): matmuls (`aten::mm`/`addmm`/`linear`/
  weight-only kernels), attention (compiled decode kernel, SDPA), the rest of aten, and the
  remainder of the step that no operator covers (Python between ops).

    .venv/bin/python -m bench.profile_step [--batch 16 64] [--steps 20] [--threads 2] [--bind]
        [--model default] [--dtype auto] [--set prepack_weights=false] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
    write_random_llama,
)

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::_weight_int4pack_mm",
              "aten::_weight_int8pack_mm", "mkldnn::_linear_pointwise", "aten::bmm",
              "aten::_weight_int4pack_mm_for_cpu", "mkl_linear", "aten::matmul",
              "switchyard_cpu::q4_mm", "switchyard_cpu::prepacked_linear")
COMPILED_MARKS = ("CompiledFxGraph", "CompiledFunction", "Torch-Compiled Region",
                  "TorchDynamo", "Pregraph", "scaled_dot_product", "graph_",
                  "switchyard_cpu::paged_")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--model", default=None, help="a model the engine loads (default: W1's)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--no-profiler", action="store_true", help="phases only")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field for A/B runs, e.g. prepack_weights=false")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


class PhaseClock:
    """Wraps an object's methods so that each call's wall time adds to a named phase."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, method: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, method, timed)


def engine_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set field=value` pairs as EngineConfig keyword arguments (bools and ints parsed)."""
    parsed: dict[str, Any] = {}
    for pair in pairs:
        field, _, text = pair.partition("=")
        value: Any = {"true": True, "false": False}.get(text.lower(), text)
        parsed[field] = int(value) if isinstance(value, str) and value.isdigit() else value
    return parsed


def build_engine(model: str, dtype: str, max_batch: int, overrides: dict[str, Any]) -> Any:
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    config = EngineConfig(model=model, dtype=dtype, max_batch_size=max_batch,
                          max_total_tokens=1024, max_batch_prefill_tokens=16384, cache_dir=None,
                          **overrides)
    engine = LLMEngine(config)
    engine.warmup()
    return engine


def start_batch(engine: Any, batch: int, prompt_len: int, tag: str) -> None:
    from backends.base import SamplingParams

    vocab = min(len(engine.tokenizer.hf) if hasattr(engine.tokenizer, "hf") else 32000, 32000)
    greedy = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(batch, prompt_len, vocab, seed=batch)):
        engine.add_request(f"{tag}-{i}", prompt, greedy)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # warm the decode shapes
        engine.step()


def time_phases(engine: Any, steps: int) -> dict[str, float]:
    clock = PhaseClock()
    clock.wrap(engine.scheduler, "schedule", "schedule")
    clock.wrap(engine.runner, "prepare", "prepare")
    clock.wrap(engine.runner.model, "forward", "forward")
    if engine.runner.decode_step is not None:  # the compiled whole-step graph
        clock.wrap(engine.runner.decode_step, "run", "forward")
    clock.wrap(engine, "_append", "append")
    import backends.native.llm_engine as engine_module

    original_sample = engine_module.sample
    clock.wrap(engine_module, "sample", "sample")
    start = time.perf_counter()
    try:
        for _ in range(steps):
            engine.step()
    finally:
        engine_module.sample = original_sample
        for owner, name in ((engine.scheduler, "schedule"), (engine.runner, "prepare"),
                            (engine.runner.model, "forward"), (engine, "_append"),
                            (engine.runner.decode_step, "run")):
            owner.__dict__.pop(name, None)
    total = time.perf_counter() - start
    per_step = {k: v / steps * 1000 for k, v in clock.seconds.items()}
    per_step["other"] = total / steps * 1000 - sum(per_step.values())
    per_step["step"] = total / steps * 1000
    return per_step


def profile_ops(engine: Any, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - start) / steps * 1000
    groups: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        name = event.key
        self_ms = event.self_cpu_time_total / 1000 / steps
        if any(name == op or name.startswith(op) for op in MATMUL_OPS):
            groups["matmul"] += self_ms
        elif any(mark in name for mark in COMPILED_MARKS):
            groups["compiled + attention"] += self_ms
        elif name.startswith("aten::") or name.startswith("mkldnn::"):
            groups["other aten"] += self_ms
    groups["python (uncovered)"] = max(0.0, wall - sum(groups.values()))
    groups["step (profiled)"] = wall
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    print("  top operators (self ms/step, calls/step):")
    for event in top:
        print(f"    {event.key[:60]:60s} {event.self_cpu_time_total / 1000 / steps:8.2f}"
              f" {event.count / steps:6.0f}")
    return dict(groups)


def finish_all(engine: Any, tag: str, batch: int) -> None:
    for i in range(batch):
        engine.abort(f"{tag}-{i}")
    while engine.has_work():
        engine.step()


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, args.bind)
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(facts_line(facts), "|", placement)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(write_random_llama(Path(tmp) / "w1"))
        engine = build_engine(model, dtype, max(args.batch), engine_overrides(args.set))
        results: dict[str, Any] = {}
        for batch in args.batch:
            tag = f"b{batch}"
            start_batch(engine, batch, args.prompt_len, tag)
            phases = time_phases(engine, args.steps)
            print(f"batch {batch}: {phases['step']:.1f} ms/step, "
                  f"{batch / phases['step'] * 1000:.0f} tok/s")
            print("  phases (ms/step): " + ", ".join(
                f"{k} {v:.2f}" for k, v in phases.items() if k != "step"))
            entry: dict[str, Any] = {"phases_ms": phases}
            if not args.no_profiler:
                ops = profile_ops(engine, args.steps)
                print("  operators (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in ops.items()))
                entry["operators_ms"] = ops
            results[str(batch)] = entry
            finish_all(engine, tag, batch)
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
