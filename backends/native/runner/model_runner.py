"""ModelRunner: owns the model and the KV cache, turns a ScheduledBatch into logits (or, for
plain greedy steps, into tokens: step_result.py; for an embedding model, into the final hidden
states its pooling needs: pooled_rows.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from backends.native.layers.attention import (
    KERNEL_PREFILL_MAX_CONTEXT,
    AttentionMetadata,
    KVCache,
    PrefillChunk,
    decode_mask,
    windowed_spans,
)
from backends.native.runner.compiled_prefill import CompiledPrefillStep
from backends.native.runner.compiled_step import CompiledDecodeStep
from backends.native.runner.greedy_head import GreedyHead
from backends.native.runner.pooled_rows import PooledRows, pooled_spans
from backends.native.runner.step_result import StepLogits, StepResult
from backends.native.scheduling.scheduler import ScheduledBatch
from backends.native.scheduling.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # the sampling sequences' rows first, in batch order
    starts: list[int]  # the row of each sequence's first new token, in batch order


class ModelRunner:
    def __init__(
        self, model: nn.Module, kv_cache: KVCache, device: torch.device,
        sliding_window: int | None, compiled: bool = False, whole_step: bool = False,
        compiled_prefill: bool = False, greedy_head: bool = False,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.sliding_window = sliding_window or 0  # the sliding layers' window (0: none)
        # Some layers slide and some attend fully: the metadata carries both layers' masks.
        self.mixed_windows = mixed_windows(model)
        self.compiled = compiled
        # Prompt attention through our C++ kernel (set at load where it fits): no masks needed.
        self.kernel_prefill = any(getattr(m, "cpu_kernel", False) for m in model.modules())
        # Plain greedy steps' tokens without the whole lm_head, where the steps are compiled.
        head = GreedyHead.of(model) if greedy_head and (whole_step or compiled_prefill) else None
        self.greedy_head_bytes = head.nbytes if head is not None else 0
        # Decode-only steps: the forward as compiled regions (mixed steps stay eager, with the
        # compiled decode attention kernel).
        self.decode_step = (
            CompiledDecodeStep(model, kv_cache, self.sliding_window, device, head,
                               self.mixed_windows)
            if whole_step and hasattr(model, "embed") and hasattr(model, "logits") else None
        )
        # Steps with prompt chunks: each layer's work around its eager attention compiled.
        self.prefill_step = (
            CompiledPrefillStep(model, kv_cache, head)
            if compiled_prefill and CompiledPrefillStep.supports(model) else None
        )

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Apply the block manager's copy-on-write copies (before the step writes)."""
        self.kv_cache.copy_blocks(pairs)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, greedy: bool = False) -> StepResult:
        """Run one step for `batch.sampling_seqs()` (S sequences, in batch order) and the
        prompt positions of `batch.prompt_spans()` (P rows): its logits [S + P, V], or with
        `greedy` (every row plain greedy, no P rows) maybe each sequence's greedy token."""
        if self._decode_only(batch):
            assert self.decode_step is not None
            result = self.decode_step.run(batch.seqs, greedy)
            if result is not None:
                return result
        inputs = self.prepare(batch)
        if inputs.meta.prefills and self.prefill_step is not None and not self.prefill_step.broken:
            result = self.prefill_step.run(
                inputs.input_ids, inputs.positions, inputs.meta, inputs.logits_indices, greedy
            )
            if result is not None:
                return result
        return StepLogits(self.model(inputs.input_ids, inputs.positions, self.kv_cache,
                                     inputs.meta, inputs.logits_indices))

    @torch.inference_mode()
    def pool(self, batch: ScheduledBatch, mode: str) -> PooledRows:
        """An embedding model's step: the float32 final hidden states of the rows its pooling
        `mode` needs (eager: no logits, no decode or prefill regions)."""
        inputs = self.prepare(batch)
        rows, spans = pooled_spans(batch, inputs.starts, mode)
        hidden = self.model.hidden(inputs.input_ids, inputs.positions, self.kv_cache,
                                   inputs.meta, self._tensor(rows))
        return PooledRows(hidden.float(), spans)

    def _decode_only(self, batch: ScheduledBatch) -> bool:
        """Every row decodes one token and samples (no prompt chunk; a row that samples has
        no prompt position left whose logprobs could be asked)."""
        if self.decode_step is None or self.decode_step.broken:
            return False
        return (all(n == 1 for n in batch.num_tokens)
                and all(batch.samples(i) for i in range(len(batch.seqs))))

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_tokens[i] != 1)
        decode = [i for i in order if batch.num_tokens[i] == 1]
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0] * len(batch.seqs)  # row of each sequence's first new token
        prefills: list[PrefillChunk] = []
        for i in order:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start, computed = len(ids), seq.num_computed_tokens
            starts[i] = start
            ids.extend(seq.token_ids[computed : computed + n])
            positions.extend(range(computed, computed + n))
            slots.extend(self._slot(seq, p) for p in range(computed, computed + n))
            if n != 1:
                prefills.append(self._prefill_chunk(seq, start, n))
        sampling = [i for i in range(len(batch.seqs)) if batch.samples(i)]
        logits_rows = [starts[i] + batch.num_tokens[i] - 1 for i in sampling]
        start_of = {id(seq): starts[i] for i, seq in enumerate(batch.seqs)}
        for seq, _, count in batch.prompt_spans():  # a span starts at the seq's first new token
            logits_rows.extend(range(start_of[id(seq)], start_of[id(seq)] + count))
        slot_tensor = self._tensor(slots)
        meta = AttentionMetadata(
            slot_blocks=slot_tensor // self.block_size,
            slot_offsets=slot_tensor % self.block_size,
            num_decode=len(decode),
            decode_block_tables=None,
            decode_mask=None,
            decode_spans=None,
            prefills=prefills,
            compiled=self.compiled,
        )
        if decode:
            self._decode_metadata(meta, [batch.seqs[i] for i in decode])
        return StepInputs(self._tensor(ids), self._tensor(positions), meta,
                          self._tensor(logits_rows), starts)

    def _slot(self, seq: Sequence, position: int) -> int:
        return seq.block_table[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _decode_metadata(self, meta: AttentionMetadata, seqs: list[Sequence]) -> None:
        context_lens = [s.num_computed_tokens + 1 for s in seqs]
        meta.decode_spans = [(0, n) for n in context_lens]
        max_blocks = max(-(-n // self.block_size) for n in context_lens)
        if self.compiled:  # at least two blocks: one compiled graph serves every length
            max_blocks = max(max_blocks, 2)
        tables = [s.block_table[:max_blocks] + [0] * (max_blocks - len(s.block_table[:max_blocks]))
                  for s in seqs]
        meta.decode_block_tables = self._tensor(tables)
        if self.compiled:
            windowed = windowed_spans(meta.decode_spans, self.sliding_window)
            if self.mixed_windows:
                meta.decode_mask = self._decode_mask(meta.decode_spans, max_blocks)
                meta.decode_window_mask = self._decode_mask(windowed, max_blocks)
            else:  # every layer attends alike: fully, or through the one window
                meta.decode_mask = self._decode_mask(windowed, max_blocks)

    def _decode_mask(self, spans: list[tuple[int, int]], max_blocks: int) -> torch.Tensor:
        """Additive [B, max_blocks * block_size] mask: 0 inside each span, -inf elsewhere."""
        starts, ends = (self._tensor(list(col)) for col in zip(*spans, strict=True))
        return decode_mask(starts, ends, max_blocks * self.block_size)

    def _prefill_chunk(self, seq: Sequence, start: int, n: int) -> PrefillChunk:
        computed = seq.num_computed_tokens
        context = computed + n
        if self.kernel_prefill and context <= KERNEL_PREFILL_MAX_CONTEXT:
            blocks = self._tensor(seq.block_table[: -(-context // self.block_size)])
            return PrefillChunk(start, n, context, None, None, blocks)
        # Without cached positions the chunk attends over its own new k/v (plain causal).
        table = None if computed == 0 else self._tensor(
            seq.block_table[: -(-context // self.block_size)])
        mask = None if computed == 0 else self._prefill_mask(computed, context, 0)
        window = self.sliding_window
        window_mask = self._prefill_mask(computed, context, window) if (
            window and context > window) else None
        return PrefillChunk(start, n, context, table, mask, window_mask=window_mask)

    def _prefill_mask(self, computed: int, context: int, window: int) -> torch.Tensor:
        """Additive [context - computed, context] mask: causal, within `window` if not 0."""
        q_pos = torch.arange(computed, context, device=self.device).unsqueeze(1)
        k_pos = torch.arange(context, device=self.device).unsqueeze(0)
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        mask = torch.zeros(allowed.shape, dtype=torch.float32, device=self.device)
        return mask.masked_fill_(~allowed, float("-inf"))


def mixed_windows(model: nn.Module) -> bool:
    """Whether some of the model's layers slide and others attend fully."""
    windows = {m.window for m in model.modules() if hasattr(m, "window")}
    return len(windows) > 1
