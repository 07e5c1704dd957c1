"""Shared by the quantized tests: fixture folders, the native engine's greedy logits, and a
dense transformers model to compare against."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from tests.fixtures.quantized._common import STEPS

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "quantized"
# bf16 logits of the tiny fixtures lie within about +-1.2, where a bf16 step is 2^-7 = 0.0078.
# Max |difference| measured over all 10 GPTQ / AWQ fixtures, 16 steps, native engine against
# transformers + gptqmodel live, the plain dequantization live and the recording, and the engine
# on gptqmodel's kernels against the recording: 0.0195 on AVX-512-BF16, 0.021 under
# ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (oneDNN's bf16 matmuls round differently
# there); the reference library's own live logits are up to 0.020 off its recording. About 4
# bf16 steps: two roundings of the same weights (scale and zero in bf16 vs w in bf16) carried
# through 2 layers. Unpacking itself is checked exactly (int4_layout_check.py).
LOGIT_TOLERANCE = 3e-2


def fixture_folder(name: str, tokenizer_dir: Path, tmp: Path) -> Path:
    """A copy of a fixture checkpoint with the shared tokenizer beside it."""
    folder = tmp / name
    shutil.copytree(FIXTURES / name, folder)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, folder / item.name)
    return folder


def reference(name: str) -> dict[str, torch.Tensor]:
    return load_file(str(FIXTURES / name / "reference.safetensors"))


def make_engine(path: Path | str, **overrides) -> LLMEngine:
    options = {"dtype": "bfloat16", "max_total_tokens": 128, "max_batch_total_tokens": 1024,
               "compile": False}
    options.update(overrides)
    return LLMEngine(EngineConfig(model=str(path), **options))


def native_greedy(engine: LLMEngine, prompt: list[int], steps: int = STEPS):
    """Greedy tokens and the float32 logits the engine sampled each of them from."""
    captured: list[torch.Tensor] = []
    run = engine.runner.run

    def capture(batch, greedy=False):  # the logits, so never the greedy head's tokens
        result = run(batch)
        captured.append(result.logits.float().clone())
        return result

    engine.runner.run = capture
    try:
        (seq,) = engine.generate(
            [prompt], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        )
    finally:
        engine.runner.run = run
    return seq.output_token_ids, torch.cat(captured)


def cached_greedy(model, prompt: list[int], steps: int = 16):
    """transformers' own decode loop (KV cache): the same kernels per step as a server."""
    return _cached_decode(model, prompt, steps, forced=None)


def teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """A transformers model's logits at each step of its KV-cache decode loop, fed `tokens`
    instead of its own choices: the same attention kernels per step as the engine's."""
    return _cached_decode(model, prompt, len(tokens), forced=tokens)[1]


def _cached_decode(model, prompt: list[int], steps: int, forced: list[int] | None):
    tokens, rows, past = [], [], None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for step in range(steps):
            out = model(input_ids=ids, cache=past, use_cache=True)
            past, row = out.cache, out.logits[0, -1].float()
            tokens.append(int(row.argmax()) if forced is None else forced[step])
            rows.append(row)
            ids = torch.tensor([[tokens[-1]]])
    return tokens, torch.stack(rows)


def assert_close_greedy(
    tokens: list[int], logits: torch.Tensor, want_tokens: list[int], want_logits: torch.Tensor,
    tolerance: float = LOGIT_TOLERANCE,
) -> None:
    assert tokens == want_tokens
    diff = (logits - want_logits).abs().max().item()
    assert diff <= tolerance, f"max abs logit difference {diff:.4f} > {tolerance}"


def dense_linear_bytes(config) -> int:
    """What the decoder layers' Linears take as bf16 weights."""
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return 2 * per_layer * config.num_hidden_layers


def quantized_linear_bytes(engine: LLMEngine) -> int:
    from backends.quantized.resident import resident_bytes

    model = engine.loaded.model
    return sum(resident_bytes(model.get_submodule(n)) for n in model.quantizable_linears())


def has_avx2() -> bool:
    return "avx2" in Path("/proc/cpuinfo").read_text()


def run_in_child(
    module: str, capability: str, *args: str, timeout: float = 900, cpu_kernels: str = "auto",
) -> str:
    """`python -m module args` with torch dispatching to `capability` (and oneDNN limited to
    AVX2 when it is avx2) and SWITCHYARD_CPU_KERNELS=`cpu_kernels`; its stdout, or the test fails
    with its output. The first child of a capability builds its kernel library (minutes on a
    busy 2-core machine), hence the long timeout."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": "1",
           "SWITCHYARD_CPU_KERNELS": cpu_kernels}
    if capability == "avx2":
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout
