"""The prompt's own logprobs, in slices (a whole prompt's [P, V] copy would not fit)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from backends.base import TokenInfo
from backends.text.token_texts import TokenTexts

# Prompt rows per log_softmax: a long prompt's [P, V] float32 copy would take gigabytes
# (8k tokens x 152k vocabulary = 5 GB).
PROMPT_ROWS_PER_SLICE = 256


def prompt_token_infos(
    logits: torch.Tensor, targets: list[int], k: int, texts: TokenTexts,
    is_special: Callable[[int], bool],
) -> list[TokenInfo]:
    """Row j of `logits` [N, V] predicts targets[j]: its raw logprob (float32 log_softmax)
    and the k most likely tokens there."""
    infos: list[TokenInfo] = []
    for start in range(0, len(targets), PROMPT_ROWS_PER_SLICE):
        end = start + PROMPT_ROWS_PER_SLICE
        infos += _slice_infos(logits[start:end], targets[start:end], k, texts, is_special)
    return infos


def _slice_infos(
    logits: torch.Tensor, targets: list[int], k: int, texts: TokenTexts,
    is_special: Callable[[int], bool],
) -> list[TokenInfo]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(targets, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in targets]
    if k > 0:
        values, indices = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        tops = [list(zip(i, v, strict=True))
                for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
    return [
        TokenInfo(t, texts(t), lp, is_special(t), texts.top(top))
        for t, lp, top in zip(targets, chosen, tops, strict=True)
    ]
