"""Prefill and mixed steps with each decoder layer's own work compiled around its attention.

A step that prefills runs its attention eagerly (a kernel call per prompt chunk, the decode
rows through the decode kernel: `attention.paged_attention`), and everything else of a layer
as two compiled regions: before the attention (input norm, fused QKV projection, rotary, the
K/V cache write) and after it (output projection, residual, post-attention norm, MLP,
residual). In eager mode that work was ~15% of a W1 prefill step in small elementwise
operators (each a pass over [rows, hidden] in memory); compiled, inductor fuses them. The two
regions are graphs that every layer runs (weights are graph inputs) with the row count
dynamic, so one pair of graphs serves every step; an int4 linear's row threshold
(`Int4Linear`: kernel below it, dequantize + matmul from it) makes it two pairs. Decode-only
steps keep to their own path (`compiled_step.py`, or eager).

A region that cannot compile marks the step `broken` and the engine prefills eagerly from then
on; the layers before it have written this step's K/V, which the eager step writes again.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from backends.native.layers.attention import (
    AttentionMetadata,
    KVCache,
    no_duck_shapes,
    paged_attention,
)
from backends.native.runner.compiled_step import (
    COMPILE_FAILURES,
    MAX_GRAPHS,
    DirectRegion,
    GraphCompiler,
    own_copy,
)
from backends.native.runner.greedy_head import GreedyHead, head_output
from backends.native.runner.step_result import StepLogits, StepResult

log = logging.getLogger(__name__)


def _before_attention(
    layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v, with k and v written to the cache here: fused into the rotary pass (an eager
    index_put of 2048 rows took ~1 ms a layer, 2% of a W1 prefill step)."""
    q, k, v = layer.before_attention(x, cos, sin)
    k_cache[slot_blocks, :, slot_offsets] = k
    v_cache[slot_blocks, :, slot_offsets] = v
    return q, k, v


def _after_attention(layer: nn.Module, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
    return layer.after_attention(x, attention)


class CompiledPrefillStep:
    """Runs steps with prompt chunks through the compiled layer halves; `broken` once a compile
    failed (the runner then keeps to the eager forward)."""

    def __init__(self, model: nn.Module, kv_cache: KVCache,
                 greedy_head: GreedyHead | None = None) -> None:
        self.model, self.kv_cache, self.greedy_head = model, kv_cache, greedy_head
        self.compiler = GraphCompiler("prefill step")
        self.broken = False
        before, after = (
            torch.compile(own_copy(fn), dynamic=False, fullgraph=True, backend=self.compiler,
                          recompile_limit=MAX_GRAPHS)
            for fn in (_before_attention, _after_attention)
        )
        # Dynamo's entry into a half (its guards over the layer and ~10 tensors) cost ~0.1 ms
        # a call, 24 calls a W1 prefill step: later calls of a known layout skip it.
        self._before = DirectRegion(before, self.compiler, _before_attention, rows=(1, 2, 3, 6, 7))
        self._after = DirectRegion(after, self.compiler, _after_attention, rows=(1, 2))

    @staticmethod
    def supports(model: nn.Module) -> bool:
        layers = getattr(getattr(model, "model", None), "layers", None)
        return (hasattr(model, "embed") and hasattr(model, "logits") and layers is not None
                and all(hasattr(layer, "before_attention") for layer in layers))

    @property
    def num_graphs(self) -> int:
        return self.compiler.num_graphs

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        logits_indices: torch.Tensor, greedy: bool = False,
    ) -> StepResult | None:
        """Float32 logits of the rows in `logits_indices`, as the model's forward returns
        them (with `greedy` and a greedy head maybe each row's token instead); None if a
        region cannot be compiled (logged once)."""
        self.compiler.shape = f"{input_ids.shape[0]} rows; dynamic rows"
        try:
            with no_duck_shapes():
                x = self._layers(input_ids, positions, meta, logits_indices)
        except COMPILE_FAILURES as exc:
            log.error("compiled prefill step unavailable, prefilling eagerly: %s",
                      str(exc).splitlines()[0])
            self.broken = True
            return None
        rows = x[:logits_indices.shape[0]]
        if self.greedy_head is None:
            return StepLogits(self.model.logits(rows))
        return head_output(self.model, self.greedy_head, self.model.final_hidden(rows), greedy)

    def _layers(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """The last layer's output rows in `logits_indices` (then maybe one more: see
        `_kept_rows`; none when no row reaches the logits). A step with a prompt chunk has two
        rows or more: the row count can be dynamic."""
        x, cos, sin = self.model.embed(input_ids, positions)
        k_caches, v_caches = self.kv_cache.k, self.kv_cache.v
        layers = self.model.model.layers
        for i, layer in enumerate(layers):
            q, k, v = self._before(layer, x, cos, sin, k_caches[i], v_caches[i],
                                   meta.slot_blocks, meta.slot_offsets)
            attention = paged_attention(q, k, v, k_caches[i], v_caches[i], meta,
                                        layer.self_attn.scale, layer.self_attn.cpu_kernel,
                                        cache_written=True, window=layer.self_attn.window)
            if i == len(layers) - 1:
                if logits_indices.shape[0] == 0:  # a prompt chunk alone, not its end
                    return x[:0]
                x, attention = _kept_rows(x, attention, logits_indices)
            x = self._after(layer, x, attention)
        return x


def _kept_rows(
    x: torch.Tensor, attention: torch.Tensor, logits_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The last layer's rows that reach the logits. The other rows of a prompt chunk only
    had to write their K/V, so its output projection and MLP run on these alone (~6% of a W1
    prefill step's linear work, 4-7% of its time). One row is taken twice: a dynamic row count
    must not be 1."""
    if logits_indices.shape[0] == 1:
        logits_indices = logits_indices.expand(2)
    return x.index_select(0, logits_indices), attention.index_select(0, logits_indices)

