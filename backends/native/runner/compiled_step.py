"""The compiled decode step: when every row of a step decodes, the forward pass runs as three
compiled regions (embedding + rotary + the step's attention metadata; one decoder layer;
final norm + lm_head), so that a step pays a few guard checks instead of thousands of eager
operator dispatches. The layer region is one graph that every decoder layer runs (its
weights are graph inputs, not constants): compiling it costs one layer's compile, not the
whole model's (a 30-layer whole-model graph took minutes to compile; this, seconds), and
measured as fast per step.

Shapes: one graph per region for batch 1 (dynamo specializes sizes of 1) and one with a
dynamic batch for the rest; block tables are padded to at least two blocks (with block 0,
masked out) so that their width stays dynamic. Row padding is never needed, so no padded row
ever writes into the cache. Prepacked (`cpu_linear.PrepackedLinear`) and int4 Linears are
custom ops the graph calls as they are, and so is a mixture-of-experts block (models/moe.py:
its data-dependent grouping of tokens by expert runs eagerly inside that one operator).

Direct calls: dynamo's entry into a region (frame callback, guards over the layer's nested
modules and ~20 tensors, input flattening) cost ~100 us a layer, a quarter of the default
model's batch-1 step. So the first step of each (batch, blocks) shape runs the layers through
dynamo and records which compiled graph each layer ran; later steps of that shape call those
graphs directly, reading their inputs by the sources dynamo traced them from. The same shape
passes the same guards (everything else they check is fixed for the engine's life), so a
direct call runs the graph dynamo would have picked. The logits region is called the same
way per batch size (its entry cost ~0.2 ms a step), and so is the embedding region per rows'
shape (it returns flat tensors; the step builds the DecodeMetadata from them).

A model whose layers mix sliding and full attention (Gemma 3, Qwen2 with `max_window_layers`)
gets both masks from the embedding region; its two kinds of layer run graphs of their own.

Models whose every layer the C++ decode layers cover (`fused_decode_layers.py`: float32 with
all-4-bit int8-dot linears, the default model's GGUF path; bf16 with every linear on our bf16
kernel) skip the layer region: one C++ call runs all layers between the embedding and logits
regions.
"""

from __future__ import annotations

import logging
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._inductor.compile_fx import compile_fx

from backends.native.layers.attention import DecodeMetadata, KVCache, decode_mask, no_duck_shapes
from backends.native.runner.fused_decode_layers import fused_decode_layers
from backends.native.runner.greedy_head import GreedyHead, head_output
from backends.native.runner.step_result import StepLogits, StepResult
from backends.native.scheduling.sequence import Sequence as Seq

log = logging.getLogger(__name__)

MIN_BLOCKS = 2  # a table of one block would be a size-1 dimension: its own graph
MAX_GRAPHS = 8  # per region: batch 1 and a dynamic batch, plus a layer that differs (GGUF)
# What a region that cannot compile raises; the step then falls back to eager for good.
COMPILE_FAILURES = (torch._dynamo.exc.TorchDynamoException,
                    torch._dynamo.exc.FailOnRecompileLimitHit)


def _embed(
    model: nn.Module, rows: torch.Tensor, block_size: int, mixed: bool = False,
) -> tuple[torch.Tensor, ...]:
    """rows [B, 4 + blocks]: token id, position, cache slot, first attended position (of a
    sliding layer, where there are any), then the block table of each row. Returns x, cos,
    sin and DecodeMetadata's fields but the block tables (`rows[:, 4:]`, a view the caller
    takes): a flat tuple of the graph's own outputs, so that later steps can call the graph
    directly. `mixed` (sliding and full layers): the full layers' mask, then the sliding
    ones'."""
    ids, positions, slots, starts = rows[:, :4].unbind(1)
    length = (rows.shape[1] - 4) * block_size
    mask = decode_mask(starts, positions + 1, length)
    x, cos, sin = model.embed(ids, positions)
    if mixed:
        full = decode_mask(torch.zeros_like(starts), positions + 1, length)
        return x, cos, sin, slots // block_size, slots % block_size, full, mask
    return x, cos, sin, slots // block_size, slots % block_size, mask


def _layer(
    layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: DecodeMetadata,
) -> torch.Tensor:
    return layer(x, cos, sin, k_cache, v_cache, meta)


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.logits(x)


def _final_hidden(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model.final_hidden(x)


def own_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a code object of its own: dynamo keeps its compiled graphs (and counts them
    against its recompile limit) per code object, so each engine gets a cache that holds only
    its own graphs and dies with it."""
    code = fn.__code__.replace(co_name=fn.__code__.co_name)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__)


@dataclass(frozen=True, eq=False)
class DirectGraph:
    """A compiled graph and how to read its inputs from the region's arguments (`L`, as
    dynamo names them)."""

    compiled: Callable[..., Any]
    read_inputs: Callable[[dict[str, Any]], tuple[Any, ...]]


def _direct_graph(gm: torch.fx.GraphModule, compiled: Callable[..., Any]) -> DirectGraph | None:
    """None unless every input has a source in the region's arguments (`L[...]`)."""
    sources = []
    for node in gm.graph.find_nodes(op="placeholder"):
        graph_arg = node.meta.get("grapharg")
        source = getattr(getattr(graph_arg, "source", None), "name", None)
        if not isinstance(source, str) or not source.startswith("L["):
            return None
        sources.append(source)
    try:
        read = eval(f"lambda L: ({''.join(f'{s}, ' for s in sources)})", {"__builtins__": {}})
    except SyntaxError:
        return None
    return DirectGraph(compiled, read)


class DirectRegion:
    """A compiled region called directly when its arguments are laid out as in a call dynamo
    already ran (each tensor's shape, strides and dtype, each other argument itself): that
    call passed the guards, and nothing else they check changes in an engine's life. Until
    then (and where the region's result is not its graph's outputs as they are) the call goes
    through dynamo, dim 0 of the arguments at `rows` marked dynamic first."""

    def __init__(self, region: Callable[..., Any], compiler: GraphCompiler,
                 traced: Callable[..., Any], rows: Sequence[int]) -> None:
        """`traced`: the function `region` compiles; its parameters name the arguments as
        dynamo's sources do (`L['x']`)."""
        self.region, self.compiler = region, compiler
        code = traced.__code__
        self.names, self.rows = code.co_varnames[:code.co_argcount], tuple(rows)
        self.graphs: dict[tuple[Any, ...], tuple[DirectGraph, bool]] = {}  # layout -> graph

    def __call__(self, *args: Any) -> Any:
        layout = tuple((a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else id(a)
                       for a in args)
        known = self.graphs.get(layout)
        if known is not None:
            graph, is_tuple = known
            outputs = graph.compiled(*graph.read_inputs(dict(zip(self.names, args, strict=True))))
            return tuple(outputs) if is_tuple else outputs[0]
        for index in self.rows:
            torch._dynamo.mark_dynamic(args[index], 0)
        result = self.region(*args)
        direct = self.compiler.take_last(result)
        if direct is not None:
            self.graphs[layout] = (direct, isinstance(result, tuple))
        return result


class GraphCompiler:
    """The dynamo backend: inductor, counting and logging each graph, and noting which graph
    ran last (`take_last`). It holds no tensors beyond one call: dynamo keeps every backend
    for the life of the process."""

    def __init__(self, step: str = "decode step") -> None:
        self.step = step  # which step's regions, for the log
        self.num_graphs = 0
        self.seconds = 0.0
        self.shape = "?"  # the call being run, for the log
        self._last: tuple[DirectGraph | None, tuple[Any, ...]] = (None, ())

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        start = time.perf_counter()
        # The wrapper's per-input stride asserts were ~20 us of each layer call (0.6 ms of
        # the default model's batch-1 step); the guards (or, for direct calls, the shape
        # key) already pin what they check.
        with torch._inductor.config.patch(size_asserts=False):
            compiled = compile_fx(gm, example_inputs)
        seconds = time.perf_counter() - start
        self.num_graphs += 1
        self.seconds += seconds
        log.info("compiled %s region %d (%s): %.2fs", self.step, self.num_graphs, self.shape,
                 seconds)
        direct = _direct_graph(gm, compiled)

        def run(*args: Any) -> Any:
            outputs = compiled(*args)
            self._last = (direct, tuple(outputs))
            return outputs

        return run

    def take_last(self, result: torch.Tensor | tuple[torch.Tensor, ...]) -> DirectGraph | None:
        """The graph that produced `result`, if the region returned the graph's outputs as
        they are (so that calling the graph directly is the region's whole work)."""
        direct, outputs = self._last
        self._last = (None, ())
        results = result if isinstance(result, tuple) else (result,)
        same = len(results) == len(outputs) and all(
            got is out for got, out in zip(results, outputs, strict=True))
        return direct if direct is not None and same else None


class CompiledDecodeStep:
    """Runs decode-only steps through the compiled regions; `broken` once a compile failed
    (the runner then keeps to the eager path)."""

    def __init__(
        self, model: nn.Module, kv_cache: KVCache, sliding_window: int | None,
        device: torch.device, greedy_head: GreedyHead | None = None, mixed: bool = False,
    ) -> None:
        """`sliding_window`: the sliding layers' window; `mixed`: other layers attend fully."""
        self.model, self.kv_cache = model, kv_cache
        self.block_size = kv_cache.block_size
        self.sliding_window, self.device, self.mixed = sliding_window, device, mixed
        self.compiler = GraphCompiler()
        self.broken = False
        self._direct: dict[tuple[int, ...], tuple[DirectGraph, ...]] = {}  # rows' shape -> layers
        self._direct_logits: dict[tuple[int, ...], DirectGraph] = {}  # x's shape -> logits
        self._direct_embed: dict[tuple[int, ...], DirectGraph] = {}  # rows' shape -> embed
        # The layers in one C++ call; it takes one mask for all of them.
        self.fused_layers = None if mixed else fused_decode_layers(model, kv_cache)
        self.greedy_head = greedy_head
        for cache in (*kv_cache.k, *kv_cache.v):  # fixed for the engine's life
            torch._dynamo.mark_static(cache)
        # Past MAX_GRAPHS a region fails to compile and the engine decodes eagerly.
        self._embed, self._layer, self._logits = (
            torch.compile(own_copy(fn), dynamic=False, fullgraph=True, backend=self.compiler,
                          recompile_limit=MAX_GRAPHS)
            # With a greedy head the last region stops at the lm_head's input.
            for fn in (_embed, _layer, _logits if greedy_head is None else _final_hidden)
        )

    @property
    def num_graphs(self) -> int:
        return self.compiler.num_graphs

    def run(self, seqs: Sequence[Seq], greedy: bool = False) -> StepResult | None:
        """Float32 logits [B, V] (row i samples for seqs[i]), or with `greedy` (every row
        plain greedy) and a greedy head maybe each row's token instead; None if a region
        cannot be compiled (logged once). Layers before a failed one have written this step's
        K/V: the eager step that follows writes the same slots again."""
        rows = self._inputs(seqs)
        batch_dims = () if rows.shape[0] == 1 else (0,)  # batch 1 gets graphs of its own
        _dynamic(rows, *batch_dims, 1)
        try:
            with no_duck_shapes():
                x = self._forward(rows, batch_dims)
        except COMPILE_FAILURES as exc:
            log.error("compiled decode step unavailable, decoding eagerly: %s",
                      str(exc).splitlines()[0])
            self.broken = True
            return None
        if self.greedy_head is None:
            return StepLogits(x)
        return head_output(self.model, self.greedy_head, x, greedy)

    def _forward(self, rows: torch.Tensor, batch_dims: tuple[int, ...]) -> torch.Tensor:
        x, cos, sin, meta = self._embedded(rows)
        for tensor in (x, cos, sin, meta.slot_blocks, meta.slot_offsets):
            _dynamic(tensor, *batch_dims)
        for tensor in (meta.block_tables, meta.mask, meta.window_mask):
            if tensor is not None:
                _dynamic(tensor, *batch_dims, 1)
        graphs = self._direct.get(tuple(rows.shape))
        if self.fused_layers is not None and self.fused_layers.rows_fit(rows.shape[0]):
            x = self.fused_layers(x, cos, sin, meta)
            _dynamic(x, *batch_dims)  # else the logits region compiles per batch size
        elif graphs is None:
            x = self._layers_through_dynamo(x, cos, sin, meta, tuple(rows.shape))
        else:
            layers, k_caches, v_caches = self.model.model.layers, self.kv_cache.k, self.kv_cache.v
            for layer, graph, k_cache, v_cache in zip(layers, graphs, k_caches, v_caches,
                                                      strict=True):
                inputs = {"layer": layer, "x": x, "cos": cos, "sin": sin, "k_cache": k_cache,
                          "v_cache": v_cache, "meta": meta}
                x = graph.compiled(*graph.read_inputs(inputs))[0]
        return self._logits_of(x)

    def _embedded(
        self, rows: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DecodeMetadata]:
        """The embedding region, called directly once dynamo has run it for rows' shape."""
        graph = self._direct_embed.get(tuple(rows.shape))
        if graph is not None:
            outputs = graph.compiled(*graph.read_inputs(
                {"model": self.model, "rows": rows, "block_size": self.block_size,
                 "mixed": self.mixed}))
        else:
            outputs = self._embed(self.model, rows, self.block_size, self.mixed)
            direct = self.compiler.take_last(outputs)
            if direct is not None:
                self._direct_embed[tuple(rows.shape)] = direct
        x, cos, sin, slot_blocks, slot_offsets, mask, *window_mask = outputs
        return x, cos, sin, DecodeMetadata(slot_blocks, slot_offsets, rows[:, 4:], mask,
                                           *window_mask)

    def _logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """The logits region (or the final hidden states', with a greedy head), called directly
        once dynamo has run it for x's shape (its entry cost ~0.2 ms a step, its guards walking
        the whole model)."""
        graph = self._direct_logits.get(tuple(x.shape))
        if graph is not None:
            return graph.compiled(*graph.read_inputs({"model": self.model, "x": x}))[0]
        logits = self._logits(self.model, x)
        direct = self.compiler.take_last(logits)
        if direct is not None:
            self._direct_logits[tuple(x.shape)] = direct
        return logits

    def _layers_through_dynamo(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: DecodeMetadata,
        shape: tuple[int, ...],
    ) -> torch.Tensor:
        """Run the layers through dynamo's guards, recording each one's graph for `shape`."""
        k_caches, v_caches = self.kv_cache.k, self.kv_cache.v
        graphs = []
        for i, layer in enumerate(self.model.model.layers):
            x = self._layer(layer, x, cos, sin, k_caches[i], v_caches[i], meta)
            graphs.append(self.compiler.take_last(x))
        if all(graphs):
            self._direct[shape] = tuple(graphs)  # type: ignore[arg-type]
        return x

    def _inputs(self, seqs: Sequence[Seq]) -> torch.Tensor:
        bs, window = self.block_size, self.sliding_window
        width = max(MIN_BLOCKS, max(s.num_computed_tokens // bs + 1 for s in seqs))
        rows = []
        for seq in seqs:
            position = seq.num_computed_tokens
            table = seq.block_table[:width]
            rows.append([
                seq.token_ids[position], position, table[position // bs] * bs + position % bs,
                max(0, position + 1 - window) if window else 0,
                *table, *[0] * (width - len(table)),
            ])
        batch = "batch 1" if len(rows) == 1 else f"batch {len(rows)}, dynamic"
        self.compiler.shape = f"{batch}, {width} blocks; dynamic blocks"
        return torch.tensor(rows, dtype=torch.long, device=self.device)


def _dynamic(tensor: torch.Tensor, *dims: int) -> None:
    for dim in dims:
        torch._dynamo.mark_dynamic(tensor, dim)
