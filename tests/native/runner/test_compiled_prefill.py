"""The compiled prefill step (`compiled_prefill.py`): prompt chunks and mixed steps through
each layer's compiled halves give the eager engine's logits in float32 and its tokens, the
warm-up compiles every graph a server meets, and a failed compile falls back to eager."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import SamplingParams
from backends.native.llm_engine import LLMEngine
from backends.native.runner.step_result import StepLogits
from tests.native.runner.test_compiled_step import _outputs, _prompts
from tests.native.test_parity import make_engine as make_parity_engine
from tests.quantized.helpers import fixture_folder


def make_engine(path: Path, **overrides: Any) -> LLMEngine:
    """The parity tests' engine (float32); the decode step eager, to compare prefill alone."""
    return make_parity_engine(path, **{"compile_decode_step": False, **overrides})


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def _step_logits(engine: LLMEngine, prompts: list[list[int]]) -> list[torch.Tensor]:
    """The logits of every step while `prompts` run to 3 tokens each."""
    captured: list[torch.Tensor] = []
    run = engine.runner.run

    def capture(batch: Any, greedy: bool = False) -> StepLogits:  # never the greedy head's
        result = run(batch)
        assert isinstance(result, StepLogits)
        captured.append(result.logits.clone())
        return result

    engine.runner.run = capture  # type: ignore[method-assign]
    try:
        engine.generate(prompts, _greedy(3))
    finally:
        del engine.runner.run
    return captured


def test_prefill_logits_match_eager(tiny_model: Callable[[str], Path]) -> None:
    """Whole prompts, chunks of a long one beside decode rows, a prefix-cache hit."""
    path = tiny_model("llama_gqa")
    options = {"block_size": 4, "max_batch_prefill_tokens": 24}
    compiled, eager = make_engine(path, **options), make_engine(path, compile=False, **options)
    prompts = _prompts(6, seed=8)
    prompts.append(prompts[1][:12] + [9, 10, 11])  # shares three blocks with prompts[1]
    got, want = _step_logits(compiled, prompts), _step_logits(eager, prompts)
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    step = compiled.runner.prefill_step
    assert step is not None and not step.broken and step.num_graphs > 0


def test_last_layer_runs_its_mlp_on_the_logits_rows_alone(
    tiny_model: Callable[[str], Path],
) -> None:
    """The other rows of a prompt chunk only write K/V in the last layer: its half after the
    attention gets the rows that reach the logits (one row taken twice: a dynamic row count
    is never 1), every other layer all rows."""
    engine = make_engine(tiny_model("llama_gqa"), block_size=4)
    step = engine.runner.prefill_step
    rows: list[int] = []
    after = step._after

    def record(layer: torch.nn.Module, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        rows.append(x.shape[0])
        return after(layer, x, attention)

    step._after = record
    engine.generate(_prompts(1, seed=3), _greedy(1))
    layers = len(engine.runner.model.model.layers)
    prompt = len(_prompts(1, seed=3)[0])
    assert rows == [prompt] * (layers - 1) + [2]


def test_later_steps_of_a_layout_call_the_halves_directly(
    tiny_model: Callable[[str], Path],
) -> None:
    """A layout's first step runs each layer's halves through dynamo and records their graphs;
    a later step of the same layout calls those graphs directly, with the eager logits."""
    path = tiny_model("llama_gqa")
    compiled = make_engine(path, block_size=4)
    eager = make_engine(path, compile=False, block_size=4)
    step = compiled.runner.prefill_step
    through_dynamo: list[str] = []
    for name in ("_before", "_after"):
        half = getattr(step, name)
        region = half.region
        half.region = lambda *args, _region=region, _name=name: (
            through_dynamo.append(_name), _region(*args))[1]
    first, second = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(31))
    layers = len(compiled.runner.model.model.layers)
    for prompt, calls in ((first.tolist(), 2 * layers), (second.tolist(), 0)):
        through_dynamo.clear()
        got, want = _step_logits(compiled, [prompt]), _step_logits(eager, [prompt])
        assert len(through_dynamo) == calls
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert len(step._before.graphs) == len(step._after.graphs) == layers


def test_chunks_that_reach_no_logits_stay_compiled(tiny_model: Callable[[str], Path]) -> None:
    """A long prompt alone, in chunks: until its last chunk no row samples, the last layer's
    half after the attention has no row to run, and the step must neither fail to compile
    nor change the logits."""
    path = tiny_model("llama_gqa")
    options = {"block_size": 4, "max_batch_prefill_tokens": 8}
    compiled, eager = make_engine(path, **options), make_engine(path, compile=False, **options)
    prompt = [token for part in _prompts(6, seed=4) for token in part][:30]
    assert len(prompt) > 16  # three chunks or more, the first two sampling nothing
    got, want = _step_logits(compiled, [prompt]), _step_logits(eager, [prompt])
    assert [a.shape[0] for a in got[:2]] == [0, 0]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert not compiled.runner.prefill_step.broken


def test_warmup_compiles_every_prefill_graph(tiny_model: Callable[[str], Path]) -> None:
    """Once warm, prompts of new lengths and mixed steps compile nothing."""
    engine = make_engine(tiny_model("llama_gqa"), block_size=4)
    engine.warmup()
    step = engine.runner.prefill_step
    assert step.num_graphs == 2  # before and after attention, rows dynamic
    prompts = _prompts(8, seed=12)
    for i, prompt in enumerate(prompts):  # each joins while the others decode
        engine.add_request(f"r{i}", prompt, _greedy(5))
        engine.step()
    while engine.has_work():
        engine.step()
    assert step.num_graphs == 2 and not step.broken


@pytest.mark.parametrize("name", ["gptq-w4-g128-sym-actorder", "gptq-w4-g64-asym-lmhead"])
def test_int4_linears_match_eager(name: str, tokenizer_dir: Path, tmp_path: Path) -> None:
    """Int4Linear in the halves on both sides of its row threshold (the warm-up's long prompt
    compiles the second pair of graphs; a long prompt after it compiles nothing)."""
    folder = fixture_folder(name, tokenizer_dir, tmp_path)
    long = torch.randint(3, 500, (140,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = _prompts(3, seed=4, vocab=500) + [long]

    assert make_engine(folder).runner.prefill_step is None  # off by default when quantized

    def run(compiled: bool) -> list[list[int]]:
        engine = make_engine(folder, compile=compiled, compile_prefill_step=True,
                             max_total_tokens=256)
        engine.warmup()
        graphs = engine.runner.prefill_step.num_graphs if compiled else 0
        got = _outputs(engine, prompts, _greedy(6))
        if compiled:
            assert not engine.runner.prefill_step.broken
            assert engine.runner.prefill_step.num_graphs == graphs == 4
        return got

    assert run(True) == run(False)


def test_compile_failure_falls_back_to_eager(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    engine = make_engine(path)
    layer = engine.runner.model.model.layers[0]
    plain = layer.before_attention

    def untraceable(*args: torch.Tensor) -> Any:
        torch._dynamo.graph_break()
        return plain(*args)

    layer.before_attention = untraceable
    prompts = _prompts(3, seed=5)
    got = _outputs(engine, prompts, _greedy(6))
    assert engine.runner.prefill_step.broken
    assert got == _outputs(make_engine(path, compile=False), prompts, _greedy(6))
