"""Workload W1: offline throughput, native engine vs transformers `generate`, in one run.

64 requests, random 128-token prompts (fixed seed), exactly 64 new tokens each (greedy, EOS
ignored), on a random ~125M Llama (stored in bf16) computed in `--dtype` (default `auto`: the
engine's choice for this CPU, bf16 only where bf16 matmul is native, float32 otherwise; both
engines use it). transformers runs one static batch of all requests;
the native engine gets them all at once and batches continuously. Output throughput is all
output tokens / wall time of the generate call (vLLM's definition), after a short warm-up.

    .venv/bin/python -m bench.w1 [--threads 2] [--bind] [--only native|hf] [--dtype auto]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    LLAMA_125M,
    RunResult,
    agreement,
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
    write_random_llama,
)

WARMUP_REQUESTS = 4
WARMUP_TOKENS = 4


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--bind", action="store_true", help="pin thread i to core i")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prefill-tokens", type=int, default=None,
        help="native max_batch_prefill_tokens (default: all prompts in one step)",
    )
    parser.add_argument("--only", choices=("native", "hf"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"),
                        default="auto", help="compute dtype of both engines (auto: the engine's)")
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    return parser.parse_args(argv)


def run_hf(folder: Path, prompts: list[list[int]], new_tokens: int, dtype: str) -> RunResult:
    """transformers generate: one static batch of every prompt, greedy."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).to(getattr(torch, dtype)).eval()
    ids = torch.tensor(prompts, dtype=torch.long)

    def generate(batch: torch.Tensor, tokens: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                max_new_tokens=tokens, min_new_tokens=tokens,
                pad_token_id=LLAMA_125M["pad_token_id"],
            )

    generate(ids[:WARMUP_REQUESTS], WARMUP_TOKENS)
    start = time.perf_counter()
    out = generate(ids, new_tokens)
    seconds = time.perf_counter() - start
    outputs = out[:, ids.shape[1]:].tolist()
    return RunResult("transformers", sum(map(len, outputs)), seconds, outputs)


def run_native(
    folder: Path, prompts: list[list[int]], new_tokens: int, threads: int, prefill: int,
    dtype: str,
) -> RunResult:
    """The native engine: every request added at once, run to completion."""
    from backends.base import SamplingParams
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    config = EngineConfig(
        model=str(folder), dtype=dtype, max_total_tokens=256,
        max_batch_size=len(prompts), max_batch_prefill_tokens=prefill, num_threads=threads,
    )
    engine = LLMEngine(config)
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    warmup = SamplingParams(max_tokens=WARMUP_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate(prompts[:WARMUP_REQUESTS], warmup)
    start = time.perf_counter()
    seqs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    outputs = [seq.output_token_ids for seq in seqs]
    return RunResult("native", sum(map(len, outputs)), seconds, outputs)


def check_lengths(result: RunResult, requests: int, new_tokens: int) -> None:
    expected = requests * new_tokens
    if result.output_tokens != expected:
        raise SystemExit(f"{result.name}: {result.output_tokens} output tokens, want {expected}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    placement = configure_threads(args.threads, args.bind)  # before torch loads
    if args.prompt_len + args.new_tokens > 256:
        raise SystemExit("--prompt-len + --new-tokens must fit max_total_tokens=256")
    prompts = random_prompts(
        args.requests, args.prompt_len, LLAMA_125M["vocab_size"], args.seed
    )
    prefill = args.prefill_tokens or args.requests * args.prompt_len
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(
        f"W1: {args.requests} requests x {args.prompt_len} prompt + {args.new_tokens} new "
        f"tokens, greedy, EOS ignored; random Llama ~125M in {dtype} (--dtype {args.dtype}); "
        f"{placement}\n{facts_line(facts)}"
    )
    results: dict[str, RunResult] = {}
    with tempfile.TemporaryDirectory(prefix="w1-") as tmp:
        folder = write_random_llama(Path(tmp), seed=args.seed)
        if args.only in (None, "hf"):
            results["hf"] = run_hf(folder, prompts, args.new_tokens, dtype)
        if args.only in (None, "native"):
            results["native"] = run_native(
                folder, prompts, args.new_tokens, args.threads, prefill, args.dtype
            )
    for result in results.values():
        check_lengths(result, args.requests, args.new_tokens)
        print(result.line())
    if len(results) == 2:
        native, hf = results["native"], results["hf"]
        ratio = native.output_throughput / hf.output_throughput
        print(f"ratio native/transformers: {ratio:.2f}x")
        print(f"greedy agreement: {agreement(native.outputs, hf.outputs)}")
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len,
                     "new_tokens": args.new_tokens, "prefill_tokens": prefill},
        **{name: {"output_tokens": r.output_tokens, "seconds": r.seconds,
                  "output_tokens_per_s": r.output_throughput} for name, r in results.items()},
    })


if __name__ == "__main__":
    main()
