"""The native engine on CUDA against transformers on the same GPU: greedy tokens of two tiny
random models (Llama with GQA; Qwen2 with biases and tied embeddings), eager and compiled
(decode step, prefill step), float32 (must match exactly) and bf16 (agreement reported).

The device machine has no default model to build a tokenizer from, so the models are written
here first and carried (see bench/gpu_check.sh):

    .venv/bin/python -m bench.gpu_engine_check --prepare .gpu    # here: writes .gpu/<arch>/
    python3 -m bench.gpu_engine_check --models .gpu              # there: prints, exits 1 on a
                                                                 # float32 mismatch or an error
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

ARCHES = ("llama_gqa", "qwen2_bias_tied")
NEW_TOKENS = 24
LENGTHS = (3, 17, 40, 9, 25, 61, 5, 33)
VARIANTS = ({"compile": False}, {"compile": True, "compile_prefill_step": True})


def allow_older_torch() -> None:
    """The device image's torch (2.11) takes no `recompile_limit` in torch.compile, which the
    engine passes (2.13, the pinned one): there, set dynamo's global limit instead."""
    import inspect

    import torch._dynamo

    compile_fn = torch.compile
    if "recompile_limit" in inspect.signature(compile_fn).parameters:
        return

    def compile_without_limit(*args: object, recompile_limit: int | None = None,
                              **kwargs: object) -> object:
        if recompile_limit is not None:
            config = torch._dynamo.config
            config.recompile_limit = max(recompile_limit, config.recompile_limit)
        return compile_fn(*args, **kwargs)

    torch.compile = compile_without_limit  # type: ignore[assignment]


def prepare(folder: Path) -> None:
    import os
    import tempfile

    from transformers import AutoTokenizer

    from backends.default_model import default_model_path
    from tests.conftest import write_tiny_model

    gguf = default_model_path()
    with tempfile.TemporaryDirectory() as tokenizer:
        AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
                                      ).save_pretrained(tokenizer)
        for arch in ARCHES:
            (folder / arch).mkdir(parents=True, exist_ok=True)
            write_tiny_model(folder / arch, Path(tokenizer), arch)
    print(f"wrote {', '.join(ARCHES)} under {folder}")


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in LENGTHS]


def reference(path: Path, dtype: torch.dtype) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    outputs = []
    for prompt in prompts():
        ids = torch.tensor([prompt], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def engine_tokens(path: Path, dtype: str, options: dict[str, bool]) -> tuple[list[list[int]], str]:
    from backends.base import SamplingParams
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=str(path), device="cuda", dtype=dtype, cache_dir=None,
                                    max_total_tokens=256, max_batch_total_tokens=4096, **options))
    engine.warmup()
    built = time.perf_counter() - start
    seqs = engine.generate(prompts(), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                     ignore_eos=True))
    runner = engine.runner
    steps = {name: None if step is None else (step.num_graphs, step.broken)
             for name, step in (("decode", runner.decode_step), ("prefill", runner.prefill_step))}
    return [s.output_token_ids for s in seqs], f"start {built:.1f} s; (graphs, broken) {steps}"


def check(models: Path) -> int:
    failures = 0
    for arch in ARCHES:
        for dtype in ("float32", "bfloat16"):
            want = reference(models / arch, getattr(torch, dtype))
            for options in VARIANTS:
                try:
                    got, info = engine_tokens(models / arch, dtype, options)
                except Exception:  # noqa: BLE001 - report it and go on to the next variant
                    failures += 1
                    print(f"{arch} {dtype} {options}: ERROR")
                    traceback.print_exc()
                    continue
                exact = sum(g == w for g, w in zip(got, want, strict=True))
                same = sum(a == b for g, w in zip(got, want, strict=True)
                           for a, b in zip(g, w, strict=True))
                failed = dtype == "float32" and exact < len(want)
                failures += failed
                print(f"{arch} {dtype} {options}: {exact}/{len(want)} sequences exact, "
                      f"{same / (len(want) * NEW_TOKENS):.0%} of tokens"
                      f"{'; MISMATCH' if failed else ''}; {info}", flush=True)
    print(f"engine on CUDA: {failures} failure(s)")
    return 1 if failures else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", type=Path, help="write the tiny models here (needs the "
                                                     "default model installed)")
    parser.add_argument("--models", type=Path, default=Path(".gpu"))
    args = parser.parse_args()
    if args.prepare:
        prepare(args.prepare)
        return
    allow_older_torch()
    sys.exit(check(args.models))


if __name__ == "__main__":
    main()
