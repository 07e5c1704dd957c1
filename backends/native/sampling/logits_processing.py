"""Logits processors applied before choosing a token, each vectorised over the batch.

Order: repetition penalty, frequency/presence penalties, logit_bias, min_tokens, grammar mask.
When the grammar allows only the stop tokens min_tokens hides, the grammar wins.
Token ids outside the logits' width are ignored rather than failing the whole batch.
logit_bias and the stop tokens are tensors made once per sequence (token_tables.py).
"""

from __future__ import annotations

import torch

from backends.native.sampling.token_tables import bias_table, rows_and_tokens, stop_table
from backends.native.scheduling.sequence import Sequence
from backends.native.structured import apply_token_bitmask


def process_logits(
    logits: torch.Tensor, seqs: list[Sequence], bitmask: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns a processed copy of `logits` [S, V], or `logits` itself when nothing applies."""
    if bitmask is None and not any(needs_processing(s) for s in seqs):
        return logits
    logits = logits.clone()
    _repetition_penalty(logits, seqs)
    _frequency_presence_penalties(logits, seqs)
    _logit_bias(logits, seqs)
    hidden = _min_tokens(logits, seqs)
    if bitmask is not None:
        apply_token_bitmask(logits, bitmask)
        if hidden is not None:
            _unhide_where_nothing_is_left(logits, bitmask, hidden)
    return logits


def needs_processing(seq: Sequence) -> bool:
    p = seq.sampling
    return (
        p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0
        or bool(p.logit_bias) or seq.num_output_tokens < p.min_tokens
    )


def _repetition_penalty(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Over prompt and output tokens, as transformers/TGI: divide positive logits, multiply
    negative ones."""
    rows = [i for i, s in enumerate(seqs) if s.sampling.repetition_penalty != 1.0]
    if not rows:
        return
    seen = token_counts([seqs[i].token_ids for i in rows], logits.shape[1], logits.device) > 0
    penalty = column([seqs[i].sampling.repetition_penalty for i in rows], logits)
    values = logits[rows]
    penalized = torch.where(values > 0, values / penalty, values * penalty)
    logits[rows] = torch.where(seen, penalized, values)


def _frequency_presence_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Over output tokens, as OpenAI: logit -= frequency * count + presence * (count > 0)."""
    rows = [
        i for i, s in enumerate(seqs)
        if s.num_output_tokens and (s.sampling.frequency_penalty or s.sampling.presence_penalty)
    ]
    if not rows:
        return
    counts = token_counts([seqs[i].output_token_ids for i in rows], logits.shape[1], logits.device)
    frequency = column([seqs[i].sampling.frequency_penalty for i in rows], logits)
    presence = column([seqs[i].sampling.presence_penalty for i in rows], logits)
    logits[rows] -= frequency * counts + presence * (counts > 0).to(logits.dtype)


def _logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    tables = [(i, bias_table(s, logits)) for i, s in enumerate(seqs) if s.sampling.logit_bias]
    tables = [(i, t) for i, t in tables if t.tokens.numel()]
    if not tables:
        return
    index = rows_and_tokens(tables, logits.device)
    bias = torch.cat([t.values for _, t in tables if t.values is not None])
    logits.index_put_(index, bias, accumulate=True)  # a repeated token adds up


_Hidden = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # rows, tokens, their old logits


def _min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> _Hidden | None:
    """Mask the stop tokens (EOS and stop_token_ids) until `min_tokens` were generated;
    returns what it masked."""
    tables = [(i, stop_table(s, logits)) for i, s in enumerate(seqs)
              if s.num_output_tokens < s.sampling.min_tokens]
    tables = [(i, t) for i, t in tables if t.tokens.numel()]
    if not tables:
        return None
    rows, tokens = rows_and_tokens(tables, logits.device)
    old = logits[rows, tokens]
    logits[rows, tokens] = float("-inf")
    return rows, tokens, old


def _unhide_where_nothing_is_left(
    logits: torch.Tensor, bitmask: torch.Tensor, hidden: _Hidden
) -> None:
    """Rows where min_tokens and the grammar together allow no token: put the stop tokens
    back (the grammar only allows ending) and mask them by the grammar alone."""
    rows, tokens, old = hidden
    dead = ~(logits > float("-inf")).any(dim=-1)
    restore = dead[rows]
    if not bool(restore.any()):
        return
    logits[rows[restore], tokens[restore]] = old[restore]
    dead_rows = dead.nonzero().squeeze(1)
    again = logits[dead_rows]
    apply_token_bitmask(again, bitmask.to(logits.device)[dead_rows])
    logits[dead_rows] = again


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token occurs in each list."""
    width = max(1, max(len(t) for t in token_lists))
    padded = torch.tensor([t + [vocab] * (width - len(t)) for t in token_lists], dtype=torch.long)
    # Column `vocab` collects the padding and any id outside the vocabulary.
    ids = padded.masked_fill_((padded < 0) | (padded > vocab), vocab).to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, device=device))
    return counts[:, :vocab]


def column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """Per-row values as an [S, 1] tensor that broadcasts against `like` [S, V]."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)

