"""Shared by our linear kernels' tests: random weights, a gate / up projection, the float64
reference with its error scale, and greedy tokens with a kernel setting off and on."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from backends.native.models.llama import FusedLinear


def random_weights(n: int, k: int, bias: bool, dtype: torch.dtype, seed: int = 0,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=generator).to(dtype)
    return weight, (torch.randn(n, generator=generator).to(dtype) if bias else None)


def gate_up_projection(f: int, k: int, dtype: torch.dtype, marked: bool = True,
                       bias: bool = False) -> FusedLinear:
    """An MLP's gate / up projection of two halves of `f`, marked for silu_mul unless not."""
    torch.manual_seed(0)
    linear = FusedLinear(k, [f, f], bias=bias, feeds_silu_mul=marked)
    nn.init.normal_(linear.weight)
    return linear.to(dtype)


def float64_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """x @ weight^T (+ bias) in float64, and the same over absolute values: the scale that
    float32 summation errors are bounded by."""
    exact = x.double() @ weight.double().t()
    magnitude = x.double().abs() @ weight.double().abs().t()
    if bias is not None:
        exact, magnitude = exact + bias.double(), magnitude + bias.double().abs()
    return exact, magnitude


def kernels_and_tokens(model: Path, dtype: str, setting: str,
                       ) -> tuple[list[str], list[list[list[int]]]]:
    """The first MLP's gate / up kernel ("+silu_mul" where it fuses the activation) and two
    prompts' greedy tokens, `setting` False then True."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13]]
    kernels, outputs = [], []
    for ours in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, compile=False,
                                        max_total_tokens=128, **{setting: ours}))
        gate_up = engine.loaded.model.model.layers[0].mlp.gate_up_proj
        kernels.append(gate_up.kernel + ("+silu_mul" if gate_up.fuses_silu_mul else ""))
        outputs.append([s.output_token_ids for s in engine.generate(prompts, greedy)])
    return kernels, outputs
