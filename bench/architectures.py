"""Each architecture the native engine runs, at one size, side by side in one process.

Random checkpoints with the shapes of W1's ~134M Llama (hidden 768, 12 layers, 12 heads,
intermediate 2048, vocabulary 32000, untied), written with transformers' own classes:
Llama, Qwen3 (q/k norms), Phi-3 (fused qkv / gate_up), Gemma 3 (GeGLU, four norms a layer,
local and global layers). Each is decoded by the native engine and by transformers `generate`
at batch 1 and at 16 requests (128-token random prompts, 64 new tokens, greedy, EOS ignored).
The table gives output tok/s, native over transformers, and native over the Llama of the same
shape, the figure an architecture's extra work should keep near 1.

    .venv/bin/python -m bench.architectures [--threads 2] [--dtype auto] [--only qwen3,phi3]
        [--batches 1,16] [--skip-hf] [--json out.json]
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

from bench.common import (  # noqa: E402
    LLAMA_125M,
    RunResult,
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_default_tokenizer,
    write_json,
)

PROMPT_LEN, NEW_TOKENS = 128, 64
SHARED = {key: LLAMA_125M[key] for key in (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "max_position_embeddings", "bos_token_id",
    "eos_token_id", "pad_token_id", "tie_word_embeddings")}


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**SHARED)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**SHARED, head_dim=64)


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(**SHARED)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Gemma 3's own layout: five local layers (window 512) to one global layer.
    return Gemma3TextConfig(**SHARED, head_dim=64, sliding_window=512, query_pre_attn_scalar=64)


ARCHITECTURES: dict[str, Callable[[], Any]] = {
    "llama": _llama, "qwen3": _qwen3, "phi3": _phi3, "gemma3": _gemma3,
}


@dataclass(frozen=True)
class ArchitectureRun:
    architecture: str
    parameters: int
    batch: int
    native: RunResult
    hf: RunResult | None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--bind", action="store_true", help="pin thread i to core i")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--only", default=",".join(ARCHITECTURES),
                        help="comma-separated architectures (llama is always run first)")
    parser.add_argument("--batches", default="1,16", help="comma-separated request counts")
    parser.add_argument("--skip-hf", action="store_true", help="native engine only")
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    return parser.parse_args(argv)


def write_checkpoint(folder: Path, config: Any) -> int:
    """A random model of `config` in bf16 with the default tokenizer; its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    write_default_tokenizer(folder)
    return sum(p.numel() for p in model.parameters())


def run_architecture(
    name: str, tmp: Path, batches: list[int], args: argparse.Namespace, dtype: str,
) -> list[ArchitectureRun]:
    from bench.w1 import run_hf, run_native

    folder = tmp / name
    parameters = write_checkpoint(folder, ARCHITECTURES[name]())
    runs = []
    for batch in batches:
        prompts = random_prompts(batch, PROMPT_LEN, SHARED["vocab_size"], seed=batch)
        native = run_native(folder, prompts, NEW_TOKENS, args.threads, batch * PROMPT_LEN,
                            args.dtype)
        hf = None if args.skip_hf else run_hf(folder, prompts, NEW_TOKENS, dtype)
        runs.append(ArchitectureRun(name, parameters, batch, native, hf))
        print(f"{name} x{batch}: {native.line()}" + (f" | {hf.line()}" if hf else ""),
              flush=True)
    return runs


def table(runs: list[ArchitectureRun]) -> str:
    llama = {run.batch: run.native.output_throughput for run in runs
             if run.architecture == "llama"}
    lines = ["| architecture | parameters | batch | native tok/s | transformers tok/s "
             "| native / transformers | native / Llama |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        native = run.native.output_throughput
        hf = run.hf.output_throughput if run.hf else float("nan")
        lines.append(
            f"| {run.architecture} | {run.parameters / 1e6:.0f}M | {run.batch} | {native:.1f} "
            f"| {hf:.1f} | {native / hf:.2f}x | {native / llama[run.batch]:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    placement = configure_threads(args.threads, args.bind)  # before torch loads
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    names = ["llama", *(n for n in args.only.split(",") if n and n != "llama")]
    unknown = [n for n in names if n not in ARCHITECTURES]
    if unknown:
        raise SystemExit(f"unknown architectures {unknown}; known: {', '.join(ARCHITECTURES)}")
    batches = [int(b) for b in args.batches.split(",")]
    print(f"architectures at W1's shape in {dtype}: {PROMPT_LEN}-token prompts, {NEW_TOKENS} "
          f"new tokens, greedy; {placement}\n{facts_line(facts)}", flush=True)
    runs: list[ArchitectureRun] = []
    with tempfile.TemporaryDirectory(prefix="architectures-") as tmp:
        for name in names:
            runs += run_architecture(name, Path(tmp), batches, args, dtype)
    print(table(runs))
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        f"{r.architecture}/{r.batch}": {
            "parameters": r.parameters,
            "native_tokens_per_s": r.native.output_throughput,
            "transformers_tokens_per_s": r.hf.output_throughput if r.hf else None,
        } for r in runs})


if __name__ == "__main__":
    main()
