"""Shared bench helpers: thread placement, a random Llama checkpoint, prompts, metrics.

Nothing here imports torch at module level: `configure_threads` must run before torch loads,
because OpenMP reads its binding variables once, when the library is loaded.
"""

from __future__ import annotations

import json
import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# W1's model: a random Llama of ~134M parameters (~125M class), bf16.
LLAMA_125M: dict[str, Any] = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "intermediate_size": 2048,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "tie_word_embeddings": False,
}


def configure_threads(threads: int, bind: bool) -> str:
    """Load torch with `threads` OpenMP threads; with `bind`, pin thread i to core i.

    Must run before anything imports torch: libgomp reads OMP_* once, when it loads. Binding
    restricts the process to cores 0..threads-1 (sched_setaffinity) and gives each OpenMP
    thread its own core (OMP_PROC_BIND/OMP_PLACES). Returns a one-line description.
    """
    if "torch" in sys.modules:
        raise RuntimeError("configure_threads must run before torch is imported")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # torch's big allocations in transparent huge pages, as `switchyard serve` has them
    # (gateway/cli.py: prefer_huge_pages); an explicit THP_MEM_ALLOC_ENABLE=0 wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cores = list(range(threads))
    if bind:
        if threads > (os.cpu_count() or 1):
            raise SystemExit(f"--bind: {threads} threads but only {os.cpu_count()} cores")
        os.sched_setaffinity(0, cores)
        os.environ["OMP_PROC_BIND"] = "close"
        os.environ["OMP_PLACES"] = ",".join(f"{{{c}}}" for c in cores)
    import torch

    torch.set_num_threads(threads)
    # torch's libgomp has read them; other bundled copies (sentencepiece's) must not bind too.
    for name in ("OMP_PROC_BIND", "OMP_PLACES"):
        os.environ.pop(name, None)
    return f"{threads} threads, " + (f"bound to cores 0-{threads - 1}" if bind else "unbound")


def resolve_bench_dtype(name: str) -> str:
    """`--dtype` for a CPU bench: `auto` is the engine's choice for this machine."""
    from backends.machine.cpu_dtype import machine_cpu_choice

    return machine_cpu_choice().name if name == "auto" else name


def machine_facts(dtype: str | None, threads: int) -> dict[str, Any]:
    """What a figure depends on: CPU model, torch's capability, native bf16, dtype, threads.

    Printed by every bench and recorded in every bench JSON, so that figures from different
    machines are never compared blind.
    """
    import torch

    from backends.machine.cpu_dtype import gather_cpu_facts, machine_cpu_choice

    facts = gather_cpu_facts()
    auto = machine_cpu_choice()  # bf16 exactly where bf16 matmul is native
    return {
        "cpu_model": facts.model_name,
        "torch_cpu_capability": facts.capability,
        "bf16_native": auto.dtype == torch.bfloat16,
        "auto_dtype_reason": auto.reason,
        "isa_caps": dict(facts.env),
        "dtype": dtype,
        "threads": threads,
        "torch": torch.__version__,
    }


def facts_line(facts: dict[str, Any]) -> str:
    caps = " ".join(f"{k}={v}" for k, v in facts["isa_caps"].items())
    return (f"machine: {facts['cpu_model']}, torch {facts['torch']} capability "
            f"{facts['torch_cpu_capability']}{' (' + caps + ')' if caps else ''}, bf16 native: "
            f"{'yes' if facts['bf16_native'] else 'no'}; dtype {facts['dtype'] or 'n/a'}, "
            f"{facts['threads']} threads")


def write_json(path: str | None, facts: dict[str, Any], results: dict[str, Any]) -> None:
    """Write `{"machine": facts, "results": results}` to `path` (nothing when path is None)."""
    if path:
        Path(path).write_text(json.dumps({"machine": facts, "results": results}, indent=2))
        print(f"wrote {path}")


def write_random_llama(folder: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a random Llama (bf16, safetensors) plus the default model's tokenizer to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA_125M, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    write_default_tokenizer(folder)
    return folder


def write_default_tokenizer(folder: Path) -> None:
    """The native engine needs a tokenizer in the folder; use the default model's (from GGUF)."""
    from transformers import AutoTokenizer
    from transformers.utils import logging

    from backends.default_model import default_model_path

    gguf = default_model_path()
    logging.set_verbosity_error()  # the GGUF tokenizer's `legacy` notice
    tokenizer = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf)
    )
    tokenizer.save_pretrained(folder)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of `length` token ids, drawn uniformly from [100, vocab)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(count)]


@dataclass(frozen=True)
class RunResult:
    """One offline run. Output throughput follows vLLM: all output tokens / wall time."""

    name: str
    output_tokens: int
    seconds: float
    outputs: list[list[int]]

    @property
    def output_throughput(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")

    def line(self) -> str:
        return (
            f"{self.name:<13} {self.output_tokens:>7} output tokens in {self.seconds:7.2f} s"
            f"  = {self.output_throughput:8.1f} output tokens/s"
        )


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """How often two greedy runs agree: identical sequences, and identical first tokens."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    first = sum(x[:1] == y[:1] for x, y in zip(a, b, strict=True))
    return f"{same}/{len(a)} identical sequences, {first}/{len(a)} identical first tokens"
