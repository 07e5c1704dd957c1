"""Greedy decoding's tokens without the whole lm_head (backends/cpu_kernels/greedy_head.cpp).

A step whose every sampling row is plain greedy (temperature 0, no logprobs, penalties, bias,
grammar or prompt logprobs) needs each row's argmax of the logits, not the logits. The lm_head
is a sixth of W1's decode step (32k x 768 of its weights, ~8 ms of a 57 ms 64-row step in
bf16); the kernel bounds every logit with an int8 pass at twice the bf16 multiply-add rate and
computes exactly, as `bf16_linear` would, only the few tokens that could be the argmax. The
token is the one the full logits would give, ties included.

It covers a bf16 lm_head on our AVX-512-BF16 kernel without bias; it keeps an int8 copy of the
weight (half its size) and a plain row-major one (its size again; none where the lm_head is
tied to the embedding table, which is that copy already), which is what it costs.
"""

from __future__ import annotations

import torch
from torch import nn

from backends.cpu_kernels.build import active_variant
from backends.native.runner.step_result import GreedyTokens, StepLogits, StepResult
from backends.native.sampling.logits_processing import needs_processing
from backends.native.scheduling.sequence import Sequence

COLUMNS = 16  # the kernel's output columns a packed block
CHUNK_ROWS = 4096  # vocabulary rows quantized at a time (float32 temporaries)
QUANTIZED_MAX = 127.0


class GreedyHead:
    """The lm_head's int8 copy, its per-token scales and norms, and the plain bf16 weight."""

    def __init__(self, weight: torch.Tensor, table: torch.Tensor | None = None) -> None:
        """`weight` [V, K] bf16; `table`: the same values already held elsewhere (a tied
        embedding table), kept as the rows instead of a copy."""
        vocab, features = weight.shape
        padded = -(-vocab // COLUMNS) * COLUMNS
        quantized = torch.zeros(padded, features, dtype=torch.int8)
        stats = torch.zeros(4, padded, dtype=torch.float32)
        stats[0] = 1.0
        for first in range(0, vocab, CHUNK_ROWS):
            chunk = weight[first:first + CHUNK_ROWS]
            last = first + chunk.shape[0]
            quantized[first:last], stats[:, first:last] = _quantize(chunk)
        self.packed = quantized.view(padded // COLUMNS, COLUMNS, features // 4, 4) \
            .permute(0, 2, 1, 3).contiguous()
        self.stats = stats
        self.rows = weight.contiguous() if table is None else table
        self.rows_are_copy = table is None

    @property
    def nbytes(self) -> int:
        """Memory the head adds to the model's weights (its rows, where not the embedding
        table's)."""
        rows = self.rows.nbytes if self.rows_are_copy else 0
        return self.packed.nbytes + self.stats.nbytes + rows

    @classmethod
    def of(cls, model: nn.Module) -> GreedyHead | None:
        """The greedy head for `model`'s lm_head, or None where the kernel does not cover it."""
        head = getattr(model, "lm_head", None)
        if not hasattr(model, "final_hidden") or not _covered(head):
            return None
        weight = unpack_bf16_kernel_weight(head.packed)
        return cls(weight, _same_table(model, weight))

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Each row's greedy token [S] int64 from the final hidden states [S, K] bf16; None
        where a row cannot be decided so (non-finite or all-zero, too many tokens within the
        bound): the caller then computes the logits."""
        tokens = torch.ops.switchyard_cpu.greedy_head_argmax(
            hidden.contiguous(), self.packed, self.stats, self.rows)
        return None if bool((tokens < 0).any()) else tokens


def plain_greedy(seqs: list[Sequence]) -> bool:
    """Whether every row only needs its argmax: greedy, no logprobs and nothing that
    changes the logits first (the caller checks for a grammar mask and prompt logprobs)."""
    return all(
        s.sampling.is_greedy and not s.sampling.logprobs
        and not s.sampling.top_logprobs and not needs_processing(s)
        for s in seqs
    )


def unpack_bf16_kernel_weight(packed: torch.Tensor) -> torch.Tensor:
    """[N / 16, K / 2, 16, 2] (cpu_linear.pack_for_bf16_kernel) -> the [N, K] weight."""
    blocks, pairs = packed.shape[:2]
    return packed.permute(0, 2, 1, 3).reshape(blocks * COLUMNS, pairs * 2)


def _covered(head: nn.Module | None) -> bool:
    return (head is not None and getattr(head, "kernel", None) == "bf16"
            and getattr(head, "bias", None) is None and not head.fuses_silu_mul
            and head.in_features % 4 == 0 and active_variant() is not None
            and hasattr(torch.ops.switchyard_cpu, "greedy_head_built")
            and bool(torch.ops.switchyard_cpu.greedy_head_built())
            and bool(torch.isfinite(head.packed).all()))


def _same_table(model: nn.Module, weight: torch.Tensor) -> torch.Tensor | None:
    """The embedding table where the lm_head is tied to it (no second row-major copy)."""
    embed = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    if (embed is None or embed.dtype != weight.dtype or embed.shape != weight.shape
            or not embed.is_contiguous() or not torch.equal(embed, weight)):
        return None
    return embed.detach()


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows and [scale, 128 * row sum, |W_v|, |W_v - scale q_v|] of bf16 rows [n, K],
    in float32 (float64 took ~6 s for a 128k x 2048 head): bf16 values are exact there, and the
    norms are rounded up past float32's errors (`_upper_norms`)."""
    exact = rows.float()
    amax = exact.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / QUANTIZED_MAX, torch.ones_like(amax))
    quantized = torch.round(exact / scale[:, None]).clamp_(-QUANTIZED_MAX, QUANTIZED_MAX)
    residual = exact - scale[:, None] * quantized
    features = rows.shape[1]
    stats = torch.stack([
        scale,
        128 * quantized.sum(dim=1),  # integers below 2^24: exact in float32
        _upper_norms(exact, features, slack=torch.zeros_like(amax)),
        # each residual off by at most 2^-24 (|scale q| + |residual|) <= 2^-23 amax
        _upper_norms(residual, features, slack=amax * 2.0**-23),
    ])
    return quantized.to(torch.int8), stats


def _upper_norms(values: torch.Tensor, features: int, slack: torch.Tensor) -> torch.Tensor:
    """Row norms at or above the true ones: float32's sum of squares is within K 2^-24 of
    itself (its square root half that), and each value within `slack` of its true one."""
    return values.norm(dim=1) * (1 + features * 2.0**-23) + slack * features**0.5


def head_output(model: nn.Module, head: GreedyHead, hidden: torch.Tensor,
                greedy: bool) -> StepResult:
    """The float32 logits of the final hidden states, or with `greedy` each row's token
    where the head decides every row."""
    if greedy:
        tokens = head.tokens(hidden)
        if tokens is not None:
            return GreedyTokens(tokens.tolist())
    return StepLogits(model.head_logits(hidden))
