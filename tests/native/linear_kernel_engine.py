"""Shared by the linear kernels' engine tests: greedy tokens with a kernel setting off and on."""

from __future__ import annotations

from pathlib import Path

from backends.base import SamplingParams
from backends.native.config import EngineConfig
from backends.native.engine import LLMEngine


def kernels_and_tokens(model: Path, dtype: str, setting: str,
                       ) -> tuple[list[str], list[list[list[int]]]]:
    """The first MLP's linear kernel and two prompts' greedy tokens, `setting` False then True."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9] * 6, [11, 12, 13]]
    kernels, outputs = [], []
    for ours in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model), dtype=dtype, compile=False,
                                        max_total_tokens=128, **{setting: ours}))
        kernels.append(engine.loaded.model.model.layers[0].mlp.gate_up_proj.kernel)
        outputs.append([s.output_token_ids for s in engine.generate(prompts, greedy)])
    return kernels, outputs
