"""Batched sampling: penalties, greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backends.native.sequence import Sequence


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # of each chosen token under the model's raw distribution


def sample(logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator) -> SamplerOutput:
    """logits [S, V] float32, one row per sequence in `seqs`."""
    logprobs_all = torch.log_softmax(logits, dim=-1)
    logits = _apply_penalties(logits, seqs)
    greedy = [s.sampling.temperature <= 0 for s in seqs]
    chosen = logits.argmax(dim=-1)
    if not all(greedy):
        rows = [i for i, g in enumerate(greedy) if not g]
        picked = _sample_rows(logits[rows], [seqs[i] for i in rows], generator)
        chosen[rows] = picked
    token_logprobs = logprobs_all.gather(1, chosen.unsqueeze(1)).squeeze(1)
    return SamplerOutput(chosen.tolist(), token_logprobs.tolist())


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if _has_penalty(s)]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i] = _penalize(logits[i], seqs[i])
    return logits


def _has_penalty(seq: Sequence) -> bool:
    p = seq.sampling
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _penalize(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.sampling
    if p.repetition_penalty != 1.0:  # over prompt and output, as transformers/TGI do
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                values * p.repetition_penalty)
    if seq.num_output_tokens and (p.frequency_penalty or p.presence_penalty):
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=row.shape[0])
        counts = counts[: row.shape[0]].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def _sample_rows(
    logits: torch.Tensor, seqs: list[Sequence], generator: torch.Generator
) -> torch.Tensor:
    temps = torch.tensor([s.sampling.temperature for s in seqs], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    logits = _top_k_top_p(logits, seqs)
    probs = torch.softmax(logits, dim=-1)
    out = torch.empty(len(seqs), dtype=torch.long)
    for i, seq in enumerate(seqs):
        gen = seq.extras.get("generator") or generator
        out[i] = torch.multinomial(probs[i], 1, generator=gen)[0]
    return out


def _top_k_top_p(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    top_k = [s.sampling.top_k for s in seqs]
    top_p = [s.sampling.top_p for s in seqs]
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
    ranks = torch.arange(vocab).unsqueeze(0)
    remove = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
    ps = torch.tensor(top_p, dtype=probs.dtype).unsqueeze(1)
    remove |= before >= ps  # keep the smallest prefix with mass >= top_p (always >= 1 token)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
