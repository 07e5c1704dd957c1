"""Mixture-of-experts decode cost against dense models, side by side in one process.

Three random checkpoints written with transformers' own classes, sharing attention, embeddings
and depth (hidden 1024, 16 layers, 16 heads / 4 KV heads, vocabulary 32000):

    moe            Qwen3-MoE: 64 experts of 512, top 8 (Qwen3-30B-A3B's ratios), ~1.7B total,
                   ~0.3B active a token
    dense-active   Qwen3 with one MLP of 8 x 512: the MoE's active parameters
    dense-total    Qwen3 with one MLP of 64 x 512: the MoE's total parameters

Each is decoded by the native engine at batch 1 and at 16 requests (128-token random prompts,
64 new tokens, greedy, EOS ignored). The table gives ms per output token and tok/s; the ratios
an MoE should hold: its time per token near dense-active's (it reads the same weights a token,
plus the router) and far below dense-total's (which reads every expert).

    .venv/bin/python -m bench.moe [--threads 2] [--dtype auto] [--batches 1,16] [--layers 16]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.architectures import write_checkpoint  # noqa: E402
from bench.common import (  # noqa: E402
    RunResult,
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
)

PROMPT_LEN, NEW_TOKENS, WARMUP_TOKENS = 128, 64, 4
EXPERTS, TOP_K, EXPERT_SIZE = 64, 8, 512
VOCAB = 32000


def _shared(layers: int) -> dict[str, Any]:
    return {"hidden_size": 1024, "num_hidden_layers": layers, "num_attention_heads": 16,
            "num_key_value_heads": 4, "head_dim": 64, "vocab_size": VOCAB,
            "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2,
            "tie_word_embeddings": False}


def _moe(layers: int) -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**_shared(layers), num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                          moe_intermediate_size=EXPERT_SIZE, intermediate_size=EXPERT_SIZE,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])


def _dense(experts: int) -> Callable[[int], Any]:
    def config(layers: int) -> Any:
        from transformers import Qwen3Config

        return Qwen3Config(**_shared(layers), intermediate_size=experts * EXPERT_SIZE)
    return config


MODELS: dict[str, Callable[[int], Any]] = {
    "moe": _moe, "dense-active": _dense(TOP_K), "dense-total": _dense(EXPERTS),
}


@dataclass(frozen=True)
class ModelRun:
    model: str
    parameters: int
    batch: int
    result: RunResult

    @property
    def ms_per_token(self) -> float:
        """Wall time per decode step: a step gives one token to each of `batch` requests."""
        return 1000 * self.result.seconds * self.batch / self.result.output_tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--bind", action="store_true", help="pin thread i to core i")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--batches", default="1,16", help="comma-separated request counts")
    parser.add_argument("--layers", type=int, default=16, help="decoder layers of each model")
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated models")
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    return parser.parse_args(argv)


def decode(folder: Path, prompts: list[list[int]], threads: int, dtype: str) -> RunResult:
    """Every request added at once and run to completion; prefill included, as users wait."""
    from backends.base import SamplingParams
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=str(folder), dtype=dtype, max_total_tokens=256, max_batch_size=len(prompts),
        max_batch_prefill_tokens=len(prompts) * PROMPT_LEN, num_threads=threads))
    engine.generate(prompts[:1], SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0,
                                                ignore_eos=True))
    start = time.perf_counter()
    seqs = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    seconds = time.perf_counter() - start
    outputs = [seq.output_token_ids for seq in seqs]
    release(engine)
    return RunResult("native", sum(map(len, outputs)), seconds, outputs)


def release(engine: Any) -> None:
    """Frees an engine's weights before the next loads: compiled regions hold the modules they
    guard on, and two 3.4 GB models plus their packed copies push a 24 GB machine into swap."""
    import gc

    import torch

    del engine
    torch._dynamo.reset()
    gc.collect()


def run_model(name: str, tmp: Path, batches: list[int], args: argparse.Namespace,
              dtype: str) -> list[ModelRun]:
    folder = tmp / name
    parameters = write_checkpoint(folder, MODELS[name](args.layers))
    runs = []
    for batch in batches:
        prompts = random_prompts(batch, PROMPT_LEN, VOCAB, seed=batch)
        run = ModelRun(name, parameters, batch, decode(folder, prompts, args.threads, dtype))
        runs.append(run)
        print(f"{name} x{batch}: {run.result.line()} ({run.ms_per_token:.1f} ms a step)",
              flush=True)
    return runs


def table(runs: list[ModelRun]) -> str:
    by = {(run.model, run.batch): run for run in runs}
    lines = ["| model | parameters | batch | ms a step | tok/s | vs moe |",
             "|---|---|---|---|---|---|"]
    for run in runs:
        moe = by.get(("moe", run.batch))
        ratio = f"{run.ms_per_token / moe.ms_per_token:.2f}x" if moe else "-"
        lines.append(f"| {run.model} | {run.parameters / 1e9:.2f}B | {run.batch} "
                     f"| {run.ms_per_token:.1f} | {run.result.output_throughput:.1f} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    placement = configure_threads(args.threads, args.bind)  # before torch loads
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise SystemExit(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"MoE against dense in {dtype}: {PROMPT_LEN}-token prompts, {NEW_TOKENS} new tokens, "
          f"greedy; {placement}\n{facts_line(facts)}", flush=True)
    runs: list[ModelRun] = []
    with tempfile.TemporaryDirectory(prefix="moe-") as tmp:
        for name in names:
            runs += run_model(name, Path(tmp), batches, args, dtype)
    print(table(runs))
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        f"{r.model}/{r.batch}": {"parameters": r.parameters, "ms_per_step": r.ms_per_token,
                                 "tokens_per_s": r.result.output_throughput} for r in runs})


if __name__ == "__main__":
    main()
