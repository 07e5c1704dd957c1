"""A request's token-id lists as tensors, built once per sequence instead of once per step.

`logit_bias` (up to the gateway's limit of entries) and the stop tokens `min_tokens` hides
(EOS and `stop_token_ids`) are fixed for a sequence's life; every decode step used to turn
them into Python lists of (row, token) pairs, `len(bias) x n` tuples a step on the engine
thread. The tensors are kept on the `Sequence` (a `TokenTable`), for the logits' width,
dtype and device.
"""

from __future__ import annotations

import torch

from backends.native.scheduling.sequence import Sequence, TokenTable


def bias_table(seq: Sequence, logits: torch.Tensor) -> TokenTable:
    """The sequence's `logit_bias` in the order given; ids outside the logits are left out."""
    table = seq.bias_table
    if table is None or not table.fits(logits):
        width = logits.shape[1]
        pairs = [(token, bias) for token, bias in seq.sampling.logit_bias if 0 <= token < width]
        tokens = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in pairs], dtype=logits.dtype, device=logits.device)
        table = TokenTable(width, logits.dtype, logits.device, tokens, values)
        seq.bias_table = table
    return table


def stop_table(seq: Sequence, logits: torch.Tensor) -> TokenTable:
    """The stop tokens (EOS and stop_token_ids) that fit the logits."""
    table = seq.stop_table
    if table is None or not table.fits(logits):
        width = logits.shape[1]
        ids = sorted(t for t in seq.eos_token_ids if 0 <= t < width)
        tokens = torch.tensor(ids, dtype=torch.long, device=logits.device)
        table = TokenTable(width, logits.dtype, logits.device, tokens)
        seq.stop_table = table
    return table


def rows_and_tokens(
    tables: list[tuple[int, TokenTable]], device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and token index tensors for `index_put_` over (row, table) pairs."""
    rows = torch.cat([torch.full((t.tokens.numel(),), i, dtype=torch.long, device=device)
                      for i, t in tables])
    return rows, torch.cat([t.tokens for _, t in tables])
