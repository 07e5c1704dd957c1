"""Loads a native model in a process whose kernel build fails in the real compiler (one source
that does not compile), under the SWITCHYARD_CPU_KERNELS of its environment. Run as
`python -m tests.cpu_kernels.broken_build_check MODEL BROKEN_SOURCE`: prints the loaded
model's `cpu_kernels` and its first greedy tokens as JSON, or exits 3 with the load's error
(last line of stderr)."""

from __future__ import annotations

import functools
import json
import logging
import sys
from pathlib import Path

import torch

from backends.base import SamplingParams
from backends.cpu_kernels import build
from backends.cpu_kernels.status import KernelsUnavailable
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine

BROKEN_SOURCE = "int broken() { return undeclared_name; }\n"


def main(model: str, source: Path) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    source.write_text(BROKEN_SOURCE)
    build.KernelBuild = functools.partial(build.KernelBuild, sources=(source,))
    try:
        engine = LLMEngine(EngineConfig(model=model, dtype="float32", max_total_tokens=64,
                                        max_batch_total_tokens=256, compile=False))
    except KernelsUnavailable as exc:
        print(f"load failed: {exc}", file=sys.stderr)
        sys.exit(3)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    (seq,) = engine.generate([[1, 2, 3]], params)
    tokens = seq.token_ids[seq.num_prompt_tokens:]
    print(json.dumps({"cpu_kernels": engine.loaded.cpu_kernels, "tokens": tokens}))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
