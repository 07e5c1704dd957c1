"""Quantized weights, side by side in one run: batch-1 decode tokens/s and W1 throughput of
the ~125M random Llama dense, GPTQ 4-bit, AWQ 4-bit, EETQ int8 and bitsandbytes nf4, then
the default model (GGUF Q4_1) kept quantized vs dequantized at load. `gptq-gptqmodel` and
`awq-gptqmodel` run the same GPTQ / AWQ checkpoints on the kernels gptqmodel picks for this
device (`--quantized-kernels gptqmodel`), next to the native ones.

Batch-1 decode: one 32-token prompt, 64 greedy new tokens; tokens/s over the decode steps
(the prefill step excluded), after a warm-up request. W1: as bench/w1.py (64 requests x 128
prompt + 64 new tokens, all submitted at once), output tokens / wall time. GPTQ / AWQ
checkpoints are the bf16 model packed by round-to-nearest (bench/quant_checkpoints.py): the
format, not the rounding algorithm, decides speed. Activations are in `--dtype` (default
`auto`: bf16 where this CPU multiplies bf16 natively, float32 otherwise).

    .venv/bin/python -m bench.quantized [--threads 2] [--bind] [--w1-requests 64]
        [--only dense,gptq,awq,eetq,nf4,gguf,gptq-gptqmodel,awq-gptqmodel] [--skip-w1]
        [--dtype auto] [--json out.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    LLAMA_125M,
    configure_threads,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
)

VARIANTS = ("dense", "gptq", "awq", "eetq", "nf4", "gguf", "gptq-gptqmodel", "awq-gptqmodel")
MODEL_VARIANTS = ("dense", "gptq", "gptq-gptqmodel", "awq", "awq-gptqmodel", "eetq", "nf4")
ALIASES = {"bf16": "dense"}  # the dense variant's name before --dtype existed
B1_PROMPT, B1_TOKENS = 32, 64


@dataclass
class Figures:
    name: str
    weight_mb: float
    decode_tps: float
    w1_tps: float | None
    outputs: list[int]

    def line(self, base: Figures | None) -> str:
        w1 = f"{self.w1_tps:8.1f}" if self.w1_tps is not None else "       -"
        speedup = f"{self.decode_tps / base.decode_tps:5.2f}x" if base else "    -"
        return (f"{self.name:<22} {self.weight_mb:9.1f} MB  batch-1 decode {self.decode_tps:7.1f}"
                f" tok/s ({speedup})   W1 {w1} tok/s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true", help="pin thread i to core i")
    parser.add_argument("--w1-requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64, help="W1 new tokens per request")
    parser.add_argument("--only", default=",".join(VARIANTS), help="comma-separated variants")
    parser.add_argument("--skip-w1", action="store_true")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"),
                        default="auto", help="activation dtype (auto: the engine's choice here)")
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    return parser.parse_args(argv)


def make_engine(
    model: str, threads: int, quantize: str | None, batch: int, kernels: str, dtype: str,
):
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(
        model=model, dtype=dtype, max_total_tokens=256, max_batch_size=batch,
        max_batch_prefill_tokens=max(batch * 128, 256), num_threads=threads, quantize=quantize,
        prefix_caching=False, quantized_kernels=kernels,
    ))


def batch1_decode(engine, prompt: list[int]) -> tuple[float, list[int]]:
    """Decode tokens/s of one request (prefill step excluded), and its greedy tokens."""
    from backends.base import SamplingParams

    greedy = SamplingParams(max_tokens=B1_TOKENS, temperature=0.0, ignore_eos=True)
    engine.generate([prompt[:8]], SamplingParams(max_tokens=8, temperature=0.0,
                                                 ignore_eos=True))  # warm-up (compile)
    seq = engine.add_request(f"b1-{time.monotonic_ns()}", prompt, greedy)
    engine.step()  # prefill + first token
    start, steps = time.perf_counter(), 0
    while engine.has_work():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - start), list(seq.output_token_ids)


def w1(engine, prompts: list[list[int]], new_tokens: int) -> float:
    from backends.base import SamplingParams

    engine.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seqs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    return sum(len(s.output_token_ids) for s in seqs) / seconds


def measure(
    name: str, model: str, quantize: str | None, args, prompts, kernels: str = "native"
) -> Figures:
    print(f"-- {name}: loading", flush=True)
    engine = make_engine(model, args.threads, quantize, len(prompts), kernels, args.dtype)
    decode, outputs = batch1_decode(engine, prompts[0][:B1_PROMPT])
    throughput = None if args.skip_w1 else w1(engine, prompts, args.new_tokens)
    figures = Figures(name, engine.loaded.weight_bytes / 1e6, decode, throughput, outputs)
    dense = f"dense {engine.loaded.dtype}".replace("torch.", "")
    print(f"   {engine.loaded.quantization or dense}: {figures.line(None)}", flush=True)
    return figures


def checkpoints(tmp: Path, wanted: set[str]) -> dict[str, tuple[str, str | None, str]]:
    """variant -> (model path, --quantize, --quantized-kernels)."""
    from bench.common import write_random_llama
    from bench.quant_checkpoints import write_quantized

    dense = write_random_llama(tmp / "dense")
    table: dict[str, tuple[str, str | None, str]] = {"dense": (str(dense), None, "native")}
    for method in ("gptq", "awq"):
        if {method, f"{method}-gptqmodel"} & wanted:
            path = str(write_quantized(dense, tmp / method, method))
            table[method] = (path, None, "native")
            table[f"{method}-gptqmodel"] = (path, None, "gptqmodel")
    table["eetq"] = (str(dense), "eetq", "native")
    table["nf4"] = (str(dense), "bitsandbytes-nf4", "native")
    return table


def agreement(a: list[int], b: list[int]) -> str:
    same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
    return f"first {same}/{len(a)} greedy tokens as dense"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    wall = time.perf_counter()
    placement = configure_threads(args.threads, args.bind)
    wanted = {ALIASES.get(name, name) for name in args.only.split(",")}
    if wanted - set(VARIANTS):
        raise SystemExit(f"--only: unknown variants {sorted(wanted - set(VARIANTS))}")
    prompts = random_prompts(args.w1_requests, 128, LLAMA_125M["vocab_size"], seed=0)
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(f"quantized weights: ~125M random Llama, {placement}; batch-1 = {B1_PROMPT}-token "
          f"prompt + {B1_TOKENS} tokens; W1 = {args.w1_requests} x (128 + {args.new_tokens})\n"
          f"{facts_line(facts)}")
    results: dict[str, Figures] = {}
    with tempfile.TemporaryDirectory(prefix="bench-q-") as tmp:
        table = checkpoints(Path(tmp), wanted)
        for name in MODEL_VARIANTS:
            if name in wanted:
                path, quantize, kernels = table[name]
                results[name] = measure(name, path, quantize, args, prompts, kernels)
    gguf: dict[str, Figures] = {}
    if "gguf" in wanted:
        gguf_prompts = random_prompts(args.w1_requests, 128, 49152, seed=0)
        gguf["kept"] = measure("default Q4_1 kept", "default", None, args, gguf_prompts)
        gguf["dequantized"] = measure("default Q4_1 dequant.", "default", "none", args,
                                      gguf_prompts)
    report(results, gguf, dtype)
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        name: {"weight_mb": f.weight_mb, "decode_tokens_per_s": f.decode_tps,
               "w1_tokens_per_s": f.w1_tps}
        for name, f in [*results.items(), *((f"gguf_{k}", v) for k, v in gguf.items())]
    })


def report(results: dict[str, Figures], gguf: dict[str, Figures], dtype: str) -> None:
    print(f"\n~125M Llama (random weights), {dtype} activations:")
    base = results.get("dense")
    for name, figures in results.items():
        same = "" if base is None or name == "dense" else "  " + agreement(
            figures.outputs, base.outputs)
        print(figures.line(base) + same)
    if gguf:
        print("\ndefault model (SmolLM2-135M-Instruct GGUF Q4_1):")
        for figures in gguf.values():
            print(figures.line(gguf.get("dequantized")))


if __name__ == "__main__":
    main()
