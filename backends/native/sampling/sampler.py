"""Batched sampling: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Logprobs come from the raw distribution; the token is chosen from the processed logits
(penalties, bias, min_tokens, grammar mask: see logits_processing.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.cpu_kernels.build import active_variant
from backends.native.sampling.logits_processing import column, process_logits
from backends.native.scheduling.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Of each chosen token under the model's raw distribution; None for every row when no row
    # asks for logprobs (the logsumexp over the vocabulary is then skipped).
    logprobs: list[float | None]
    # Per row, the seq.sampling.top_logprobs most likely (token, logprob), most likely first.
    top_logprobs: list[list[tuple[int, float]]]


def sample(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator,
    bitmask: torch.Tensor | None = None,
) -> SamplerOutput:
    """logits [S, V], row i for seqs[i]; bitmask [S, ceil(V/32)] int32 of allowed tokens.

    Sampled rows draw from seq.generator when set, else from `generator`.
    """
    logits = logits.float()
    # The whole [S, V] log-softmax only where a row asks for its top tokens (~1 ms a step at
    # 64 rows of a 32k vocabulary); the chosen tokens' logprobs need one logsumexp a row.
    logprobs = torch.log_softmax(logits, dim=-1) if _wants_top(seqs) else None
    processed = process_logits(logits, seqs, bitmask)
    chosen = _argmax(processed, logits)
    rows = [i for i, s in enumerate(seqs) if not s.sampling.is_greedy]
    if rows:
        drawn = _sample_rows(processed[rows], [seqs[i] for i in rows], generator)
        chosen[rows] = torch.where(drawn >= 0, drawn, chosen[rows])
    if logprobs is None and not any(s.sampling.logprobs for s in seqs):
        return SamplerOutput(chosen.tolist(), [None] * len(seqs), [[] for _ in seqs])
    if logprobs is None:
        chosen_logprobs = (logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
                           - torch.logsumexp(logits, dim=-1))
        return SamplerOutput(chosen.tolist(), chosen_logprobs.tolist(), [[] for _ in seqs])
    chosen_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return SamplerOutput(chosen.tolist(), chosen_logprobs.tolist(), _top_logprobs(logprobs, seqs))


def _wants_top(seqs: list[Sequence]) -> bool:
    return any(s.sampling.top_logprobs > 0 for s in seqs)


def _argmax(processed: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """Greedy choice per row; a row the processors left without any token (or NaN) falls
    back to the raw argmax rather than to token 0."""
    chosen = row_argmax(processed)
    # argmax returns a NaN's index if the row has one, and a -inf's if the row has nothing
    # else: the chosen value alone says whether the row is dead (no pass over the vocabulary).
    dead = ~(processed.gather(1, chosen.unsqueeze(1)).squeeze(1) > float("-inf"))
    if not bool(dead.any()):
        return chosen
    return torch.where(dead, row_argmax(raw), chosen)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of float32 [S, V] logits; on CPU our kernel (`row_argmax.cpp`, 6-12x
    faster than torch's at 32k-49k columns), same answers, NaN rows included."""
    if (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.stride(-1) == 1 and x.shape[-1] > 0 and active_variant() is not None):
        return torch.ops.switchyard_cpu.row_argmax(x)
    return x.argmax(dim=-1)


def _top_logprobs(logprobs: torch.Tensor, seqs: list[Sequence]) -> list[list[tuple[int, float]]]:
    k = min(max((s.sampling.top_logprobs for s in seqs), default=0), logprobs.shape[1])
    if k <= 0:
        return [[] for _ in seqs]
    values, ids = logprobs.topk(k, dim=-1)
    values, ids = values.tolist(), ids.tolist()
    return [
        list(zip(ids[i][: s.sampling.top_logprobs], values[i][: s.sampling.top_logprobs],
                 strict=True))
        for i, s in enumerate(seqs)
    ]


def _sample_rows(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator
) -> torch.Tensor:
    """One drawn token per row; -1 for a row with nothing to draw from (all -inf or NaN)."""
    logits = logits / column([s.sampling.temperature for s in seqs], logits)
    logits = _min_p(logits, seqs)
    logits = _top_k_top_p(logits, seqs)
    probs = torch.softmax(logits, dim=-1)
    # Inverse-CDF sampling with one uniform per row from that row's (CPU) generator, so a
    # seed reproduces on any device. u is in (0, 1], and the first index whose cumulative
    # mass reaches u * total always has a non-zero probability.
    u = [1.0 - float(torch.rand((), generator=_generator(s, generator), dtype=torch.float64))
         for s in seqs]
    cdf = probs.double().cumsum(dim=-1)
    target = torch.tensor(u, dtype=cdf.dtype, device=cdf.device).unsqueeze(1) * cdf[:, -1:]
    drawn = torch.searchsorted(cdf, target).squeeze(1).clamp_(max=logits.shape[1] - 1)
    total = cdf[:, -1]
    return torch.where(torch.isfinite(total) & (total > 0), drawn, -1)


def _generator(seq: Sequence, shared: torch.Generator) -> torch.Generator:
    return shared if seq.generator is None else seq.generator


def _min_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Drop tokens with probability < min_p * the top token's, i.e. logit < max + log(min_p)."""
    min_p = [s.sampling.min_p for s in seqs]
    if all(p <= 0 for p in min_p):
        return logits
    floor = logits.amax(dim=-1, keepdim=True) + column(min_p, logits).log()
    return logits.masked_fill(logits < floor, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_k = [s.sampling.top_k for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = column([k if 0 < k < vocab else vocab for k in top_k], logits)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    remove = ranks >= ks
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    ps = column([p if p < 1.0 else 2.0 for p in top_p], probs)  # 2.0: rounding never cuts
    remove |= before >= ps  # keep the smallest prefix with mass >= top_p
    remove[:, 0] = False  # the top token always stays, even when a tiny top_p rounds to 0
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)

