"""Sampler: greedy, seeds, top-k / top-p support, penalties."""

from __future__ import annotations

import torch

from backends.base import SamplingParams
from backends.native.sampler import sample
from backends.native.sequence import Sequence


def _seq(seed: int | None = None, **params) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(**params), max_tokens=8)
    if seed is not None:
        seq.extras["generator"] = torch.Generator().manual_seed(seed)
    return seq


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_picks_argmax_and_reports_its_logprob() -> None:
    logits = _logits(3)
    out = sample(logits, [_seq(temperature=0.0) for _ in range(3)], torch.Generator())
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(out.logprobs), expected)


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = _logits(1, vocab=1000)

    def run(seed: int) -> list[int]:
        seq = _seq(seed=seed, temperature=1.5)
        return [sample(logits, [seq], torch.Generator()).token_ids[0] for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_top_k_one_is_greedy() -> None:
    logits = _logits(4)
    seqs = [_seq(temperature=1.0, top_k=1) for _ in range(4)]
    out = sample(logits, seqs, torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.full((1, 10), -10.0)
    logits[0, 3], logits[0, 5] = 5.0, 4.0  # ~0.73 and ~0.27 of the mass
    seen = set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        seen.add(sample(logits, [_seq(temperature=1.0, top_p=0.5)], gen).token_ids[0])
    assert seen == {3}
    for _ in range(200):
        seen.add(sample(logits, [_seq(temperature=1.0, top_p=0.99)], gen).token_ids[0])
    assert seen == {3, 5}


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2] = 1.0  # token 2 is in the prompt
    logits[0, 7] = 0.9
    out = sample(logits, [_seq(temperature=0.0, repetition_penalty=2.0)], torch.Generator())
    assert out.token_ids == [7]
