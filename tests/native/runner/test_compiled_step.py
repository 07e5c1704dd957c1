"""The compiled decode step (`compiled_step.py`): the same tokens as the eager
engine (`compile=False`) in float32, at every batch size, through forks and preemption, with
a bounded number of graphs and none compiled once warm."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from backends.base import SamplingParams
from backends.native.llm_engine import LLMEngine
from backends.native.runner.compiled_step import GraphCompiler
from tests.native.test_parity import assert_all_blocks_free
from tests.native.test_parity import make_engine as make_parity_engine
from tests.quantized.helpers import fixture_folder

LENGTHS = [3, 17, 40, 9, 25, 61, 5, 33]


def _prompts(count: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist()
            for n in (LENGTHS * 2)[:count]]


def make_engine(path: Path, **overrides: Any) -> LLMEngine:
    """The parity tests' engine with the compiled decode step on (the default, said here)."""
    return make_parity_engine(path, **{"compile_decode_step": True, **overrides})


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


class RegionCounter:
    """Counts the calls of one of the compiled step's regions: `_logits_of` runs once a step
    that goes through the graphs; `_layer` and `_logits` are dynamo's entries (not a direct
    call of a recorded graph)."""

    def __init__(self, engine: LLMEngine, region: str) -> None:
        step = engine.runner.decode_step
        assert step is not None
        self.calls = 0
        inner = getattr(step, region)

        def counted(*args: Any) -> torch.Tensor:
            self.calls += 1
            return inner(*args)

        setattr(step, region, counted)


@pytest.fixture(scope="module")
def engines(tiny_model: Callable[[str], Path]) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    path = tiny_model("llama_gqa")
    options = {"block_size": 4, "max_batch_total_tokens": 2048}
    compiled = make_engine(path, **options)
    compiled.warmup()
    yield compiled, make_engine(path, compile=False, **options)


def _outputs(engine: LLMEngine, prompts: list[list[int]], sampling: Any) -> list[list[int]]:
    seqs = engine.generate(prompts, sampling)
    assert all(s.finish_reason == "length" for s in seqs)
    assert_all_blocks_free(engine)
    return [c.output_token_ids for s in seqs for c in s.choices or [s]]


def test_warmup_compiles_both_graphs(engines: tuple[LLMEngine, LLMEngine]) -> None:
    step = engines[0].runner.decode_step
    assert step is not None and not step.broken
    assert step.num_graphs == 6  # embed, one layer, logits: each for batch 1 and a dynamic batch


def test_a_mixed_step_of_new_proportions_compiles_nothing(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """The warm-up's mixed step attends two decode rows over tables two blocks wide; a step
    whose rows and table width differ must reuse that attention graph (duck sizing tied the
    two sizes, and the first such step compiled again inside a client's request)."""
    compiled = engines[0]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled.add_request("long", _prompts(2, seed=5)[1], _greedy(4))  # 17 tokens: 5 blocks
    compiled.step()
    compiled.add_request("short", [5, 6, 7], _greedy(4))
    compiled.step()  # one decode row (padded to two) over 5 blocks, beside a prefill
    while compiled.has_work():
        compiled.step()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8, 13])
def test_same_tokens_as_eager(engines: tuple[LLMEngine, LLMEngine], batch: int) -> None:
    compiled, eager = engines
    counter = RegionCounter(compiled, "_logits_of")
    graphs = compiled.runner.decode_step.num_graphs
    prompts = _prompts(batch, seed=batch)
    assert _outputs(compiled, prompts, _greedy(24)) == _outputs(eager, prompts, _greedy(24))
    assert counter.calls >= 20  # the decode steps ran through the graph
    assert compiled.runner.decode_step.num_graphs == graphs  # warm: nothing compiled


def test_later_steps_of_a_shape_call_the_layer_graphs_directly(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    """Each (batch, blocks) shape's first step runs the layers through dynamo and records
    their graphs; the shape's later steps call those graphs directly, same tokens."""
    compiled, eager = engines
    step = compiled.runner.decode_step
    steps, through_dynamo = RegionCounter(compiled, "_logits_of"), RegionCounter(compiled, "_layer")
    shapes = len(step._direct)
    prompts = _prompts(4, seed=21)
    assert _outputs(compiled, prompts, _greedy(24)) == _outputs(eager, prompts, _greedy(24))
    new_shapes = len(step._direct) - shapes
    assert 0 < new_shapes < steps.calls
    assert through_dynamo.calls == len(compiled.runner.model.model.layers) * new_shapes


def test_later_steps_of_a_batch_size_call_the_logits_graph_directly(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    compiled, eager = engines
    step = compiled.runner.decode_step
    steps = RegionCounter(compiled, "_logits_of")
    through_dynamo = RegionCounter(compiled, "_logits")
    batch_sizes = len(step._direct_logits)
    prompts = _prompts(6, seed=23)
    assert _outputs(compiled, prompts, _greedy(24)) == _outputs(eager, prompts, _greedy(24))
    assert steps.calls >= 20
    assert through_dynamo.calls == len(step._direct_logits) - batch_sizes >= 1


def test_later_steps_of_a_shape_call_the_embedding_graph_directly(
    engines: tuple[LLMEngine, LLMEngine],
) -> None:
    compiled, eager = engines
    step = compiled.runner.decode_step
    steps, through_dynamo = RegionCounter(compiled, "_embedded"), RegionCounter(compiled, "_embed")
    shapes = len(step._direct_embed)
    prompts = _prompts(11, seed=25)  # a batch size no test before ran
    assert _outputs(compiled, prompts, _greedy(24)) == _outputs(eager, prompts, _greedy(24))
    assert steps.calls >= 20
    assert through_dynamo.calls == len(step._direct_embed) - shapes >= 1


def test_the_compiler_notes_a_graph_of_several_outputs() -> None:
    compiler = GraphCompiler()
    region = torch.compile(lambda x, w: (x @ w, x.sum(1)), backend=compiler, fullgraph=True)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    product, sums = region(x, w)
    graph = compiler.take_last((product, sums))
    assert graph is not None
    direct = graph.compiled(*graph.read_inputs({"x": x, "w": w}))
    assert torch.equal(direct[0], product) and torch.equal(direct[1], sums)
    product, sums = region(x, w)
    assert compiler.take_last((sums, product)) is None  # not as the graph returned them


def test_the_compiler_notes_the_graph_that_ran() -> None:
    compiler = GraphCompiler()
    region = torch.compile(lambda x, w: (x @ w).relu(), backend=compiler, fullgraph=True)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    out = region(x, w)
    graph = compiler.take_last(out)
    assert graph is not None
    assert torch.equal(graph.compiled(*graph.read_inputs({"x": x, "w": w}))[0], out)
    assert compiler.take_last(out) is None  # taken
    region(x, w)
    assert compiler.take_last(torch.zeros(1)) is None  # not what the region returned


def test_forks_with_seeds_match_eager(engines: tuple[LLMEngine, LLMEngine]) -> None:
    """n choices share the prompt's blocks; copy on write keeps each choice's tokens apart."""
    compiled, eager = engines
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=7, n=3, ignore_eos=True),
              _greedy(12)]
    prompts = _prompts(2, seed=11)
    assert _outputs(compiled, prompts, params) == _outputs(eager, prompts, params)


def test_plain_dense_linears_match_eager(tiny_model: Callable[[str], Path]) -> None:
    """Without prepacked weights the graph holds plain Linears."""
    path = tiny_model("qwen2_bias_tied")
    compiled = make_engine(path, prepack_weights=False)
    prompts = _prompts(4, seed=9)
    got = _outputs(compiled, prompts, _greedy(12)) + _outputs(compiled, prompts[:1], _greedy(6))
    eager = make_engine(path, compile=False, prepack_weights=False)
    assert got == _outputs(eager, prompts, _greedy(12)) + _outputs(eager, prompts[:1], _greedy(6))
    step = compiled.runner.decode_step
    assert not step.broken and step.num_graphs == 6


@pytest.mark.parametrize("name", ["gptq-w4-g128-sym-actorder", "gptq-w8-g64-asym",
                                  "gptq-w4-g64-asym-lmhead"])
def test_int4_linears_match_eager(
    name: str, tokenizer_dir: Path, tmp_path: Path,
) -> None:
    """Int4Linear in the graph: act order, an 8-bit weight as two 4-bit halves, a quantized
    lm_head."""
    folder = fixture_folder(name, tokenizer_dir, tmp_path)
    prompts = _prompts(3, seed=4, vocab=500)

    def run(compiled: bool) -> list[list[int]]:
        engine = make_engine(folder, compile=compiled)
        got = _outputs(engine, prompts, _greedy(10)) + _outputs(engine, prompts[:1], _greedy(6))
        step = engine.runner.decode_step
        assert step is None or (not step.broken and step.num_graphs <= 6)
        return got

    assert run(True) == run(False)


def test_preemption_matches_eager(tiny_model: Callable[[str], Path]) -> None:
    """KV blocks far too few for eight sequences: preempted ones recompute, same tokens."""
    path = tiny_model("mistral_window")  # and a sliding window the decode mask must keep
    options = {"max_total_tokens": 96, "max_batch_total_tokens": 112, "block_size": 8}
    compiled = make_engine(path, **options)
    prompts = _prompts(8, seed=3)
    got = _outputs(compiled, prompts, _greedy(32))
    assert compiled.scheduler.num_preemptions > 0
    assert got == _outputs(make_engine(path, compile=False, **options), prompts, _greedy(32))
    step = compiled.runner.decode_step
    assert step is not None and not step.broken and step.num_graphs <= 6


def test_compile_failure_falls_back_to_eager(tiny_model: Callable[[str], Path]) -> None:
    path = tiny_model("llama_gqa")
    engine = make_engine(path)
    norm = engine.runner.model.model.norm
    plain = norm.forward

    def untraceable(x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()
        return plain(x)

    norm.forward = untraceable
    prompts = _prompts(3, seed=5)
    got = _outputs(engine, prompts, _greedy(8))
    assert engine.runner.decode_step.broken
    assert got == _outputs(make_engine(path, compile=False), prompts, _greedy(8))


def test_graph_limit_falls_back_to_eager(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past its graph limit the engine decodes eagerly instead of compiling on."""
    monkeypatch.setattr("backends.native.runner.compiled_step.MAX_GRAPHS", 1)
    path = tiny_model("llama_gqa")
    engine = make_engine(path)
    prompts = _prompts(3, seed=6)
    got = _outputs(engine, prompts, _greedy(6)) + _outputs(engine, prompts[:1], _greedy(6))
    step = engine.runner.decode_step
    assert step.num_graphs == 3 and step.broken  # each region's first graph
    eager = make_engine(path, compile=False)
    assert got == _outputs(eager, prompts, _greedy(6)) + _outputs(eager, prompts[:1], _greedy(6))
