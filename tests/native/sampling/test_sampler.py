"""Sampler: greedy, seeds, top-k / top-p / min-p support, penalties, bias, min_tokens,
grammar bitmasks, logprobs — each checked against a plain per-row reference."""

from __future__ import annotations

import math

import pytest
import torch

from backends.base import GREEDY_TEMPERATURE, SamplingParams
from backends.cpu_kernels.build import active_variant
from backends.native.sampling.logits_processing import process_logits
from backends.native.sampling.sampler import row_argmax, sample
from backends.native.scheduling.sequence import Sequence


def _seq(
    seed: int | None = None, prompt: list[int] | None = None, output: tuple[int, ...] = (),
    eos: frozenset[int] = frozenset(), **params,
) -> Sequence:
    seq = Sequence("r", prompt or [1, 2, 3], SamplingParams(**params), max_tokens=64,
                   eos_token_ids=eos)
    seq.token_ids.extend(output)
    if seed is not None:
        seq.generator = torch.Generator().manual_seed(seed)
    return seq


def _logits(rows: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def _support(logits_row: torch.Tensor, draws: int = 400, **params) -> set[int]:
    """Tokens drawn from one logits row by `draws` independently seeded sequences."""
    seqs = [_seq(seed=i, **params) for i in range(draws)]
    out = sample(logits_row.expand(draws, -1), seqs, torch.Generator())
    return set(out.token_ids)


def test_greedy_picks_argmax_and_reports_its_logprob() -> None:
    logits = _logits(3)
    out = sample(logits, [_seq(temperature=0.0, logprobs=True) for _ in range(3)],
                 torch.Generator())
    assert out.token_ids == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).max(-1).values
    assert torch.allclose(torch.tensor(out.logprobs), expected)
    assert out.top_logprobs == [[], [], []]


@pytest.mark.parametrize("vocab", [1, 7, 8, 49152 + 3])
def test_row_argmax_answers_as_torch(vocab: int) -> None:
    """Our argmax kernel: first index of the row's max, ties, +-inf, all -inf and NaN rows
    (the first NaN), rows past a multiple of 8 columns, a row of a wider tensor."""
    if active_variant() is None:
        pytest.skip("no C++ kernels for this CPU")
    rows = _logits(9, vocab, seed=vocab)
    last = vocab - 1
    rows[1, last] = rows[1, last // 2] = rows[1].max() + 1  # a tie: the first one wins
    rows[2, last] = float("inf")
    rows[3] = float("-inf")
    rows[4, last] = float("nan")
    rows[5, last // 3] = float("nan")
    rows[5, last] = float("nan")
    rows[6, last] = rows[6].max() + 1  # the max in the tail past the vector loop
    rows[7] = 0.0
    rows[7, last] = -0.0
    wider = torch.cat([rows, rows], dim=1)[:, :vocab]  # rows contiguous, stride 2 * vocab
    for logits in (rows, wider, rows[:1]):
        assert torch.equal(row_argmax(logits), logits.argmax(dim=-1)), vocab


def test_logprobs_only_when_a_row_asks() -> None:
    logits = _logits(3)
    plain = sample(logits, [_seq(temperature=0.0) for _ in range(3)], torch.Generator())
    assert plain.logprobs == [None, None, None]
    assert plain.token_ids == logits.argmax(-1).tolist()
    mixed = sample(logits, [_seq(temperature=0.0), _seq(temperature=0.0, logprobs=True),
                            _seq(temperature=0.0)], torch.Generator())
    assert mixed.token_ids == plain.token_ids
    assert mixed.logprobs[1] == pytest.approx(torch.log_softmax(logits[1], -1).max().item(),
                                              abs=1e-6)


def test_same_seed_same_tokens_other_seed_differs() -> None:
    logits = _logits(1, vocab=1000)

    def run(seed: int) -> list[int]:
        seq = _seq(seed=seed, temperature=1.5)
        return [sample(logits, [seq], torch.Generator()).token_ids[0] for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch() -> None:
    logits = _logits(4, vocab=1000)

    def alone(seed: int) -> list[int]:
        seq = _seq(seed=seed, temperature=1.0)
        return [sample(logits[2:3], [seq], torch.Generator()).token_ids[0] for _ in range(10)]

    seeded = _seq(seed=5, temperature=1.0)
    others = [_seq(temperature=1.0), _seq(seed=9, temperature=0.7), _seq(temperature=0.0)]
    shared = torch.Generator().manual_seed(0)
    in_batch = [
        sample(logits, [others[0], others[1], seeded, others[2]], shared).token_ids[2]
        for _ in range(10)
    ]
    assert in_batch == alone(5)


def test_rows_without_a_generator_use_the_shared_one() -> None:
    logits = _logits(3, vocab=1000)

    def run(seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(seed)
        return [sample(logits, [_seq(temperature=1.0)] * 3, gen).token_ids for _ in range(10)]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_top_k_one_is_greedy() -> None:
    logits = _logits(4)
    seqs = [_seq(temperature=1.0, top_k=1) for _ in range(4)]
    out = sample(logits, seqs, torch.Generator().manual_seed(0))
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus() -> None:
    logits = torch.full((1, 10), -10.0)
    logits[0, 3], logits[0, 5] = 5.0, 4.0  # ~0.73 and ~0.27 of the mass
    assert _support(logits[0], temperature=1.0, top_p=0.5) == {3}
    assert _support(logits[0], temperature=1.0, top_p=0.99) == {3, 5}


def _reference_support(
    logits_row: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
    min_p: float = 0.0,
) -> set[int]:
    """transformers' order: temperature, top-k, top-p (on the renormalised top-k), min-p."""
    probs = torch.softmax(logits_row.double() / temperature, -1).tolist()
    order = sorted(range(len(probs)), key=lambda t: -probs[t])
    kept = order[:top_k] if top_k > 0 else order
    mass = sum(probs[t] for t in kept)
    nucleus, cumulative = [], 0.0
    for t in kept:
        nucleus.append(t)
        cumulative += probs[t] / mass
        if cumulative >= top_p:
            break
    top = probs[order[0]]
    return {t for t in nucleus if probs[t] >= min_p * top}


# Probabilities chosen so every reference boundary is far from a tie.
_PROBS = [0.30, 0.22, 0.16, 0.11, 0.08, 0.05, 0.035, 0.025, 0.012, 0.008]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0, "min_p": 0.2},
        {"temperature": 2.0, "min_p": 0.25},  # flatter after temperature: more survive
        {"temperature": 0.5, "min_p": 0.1},
        {"temperature": 1.0, "top_k": 4},
        {"temperature": 1.0, "top_p": 0.75},
        {"temperature": 1.0, "top_k": 6, "top_p": 0.8},
        {"temperature": 1.5, "top_k": 7, "top_p": 0.9, "min_p": 0.35},
    ],
)
def test_sampled_support_matches_the_reference(params: dict) -> None:
    shuffled = torch.randperm(len(_PROBS), generator=torch.Generator().manual_seed(3))
    logits = torch.full((40,), -30.0)
    logits[shuffled] = torch.tensor(_PROBS).log() + 2.0
    expected = _reference_support(logits, **params)
    assert 1 < len(expected) < len(_PROBS)
    assert _support(logits, draws=600, **params) == expected


def test_repetition_penalty_discourages_seen_tokens() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 2] = 1.0  # token 2 is in the prompt
    logits[0, 7] = 0.9
    out = sample(logits, [_seq(temperature=0.0, repetition_penalty=2.0)], torch.Generator())
    assert out.token_ids == [7]


def _reference_processed(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    out = logits.clone()
    vocab = logits.shape[1]
    for row, seq in zip(out, seqs, strict=True):
        p = seq.sampling
        for t in set(seq.token_ids):
            penalty = p.repetition_penalty
            row[t] = row[t] / penalty if row[t] > 0 else row[t] * penalty
        for t in set(seq.output_token_ids):
            count = seq.output_token_ids.count(t)
            row[t] -= p.frequency_penalty * count + p.presence_penalty
        for t, bias in p.logit_bias:
            if 0 <= t < vocab:
                row[t] += bias
        if seq.num_output_tokens < p.min_tokens:
            for t in seq.eos_token_ids:
                row[t] = float("-inf")
    return out


def test_penalties_bias_and_min_tokens_change_exactly_the_right_logits() -> None:
    seqs = [
        _seq(temperature=0.0, logprobs=True),  # untouched; asks for logprobs (every row gets them)
        _seq(prompt=[4, 5, 5], output=(6, 6, 6, 7), temperature=0.0, repetition_penalty=1.3),
        _seq(prompt=[4, 5], output=(6, 6, 6, 7, 8, 6), temperature=0.0,
             frequency_penalty=0.4, presence_penalty=0.7),
        _seq(output=(9,), temperature=1.0, frequency_penalty=-0.5),
        _seq(temperature=0.0, logit_bias=((3, 5.0), (11, -100.0), (999, 1.0))),  # 999: ignored
        _seq(prompt=[10, 11], output=(11, 12, 12), eos=frozenset({2, 13}), min_tokens=5,
             repetition_penalty=0.8, frequency_penalty=1.0, presence_penalty=-0.3,
             logit_bias=((12, 2.0), (0, -1.0))),
        _seq(output=(1, 2), eos=frozenset({2, 13}), min_tokens=2),  # reached: not masked
    ]
    logits = _logits(len(seqs), vocab=20, seed=4) * 3
    processed = process_logits(logits, seqs)
    expected = _reference_processed(logits, seqs)
    assert torch.allclose(processed, expected, atol=1e-6, rtol=0)
    assert torch.equal(processed[0], logits[0]) and torch.equal(processed[6], logits[6])
    assert torch.isinf(processed[5, [2, 13]]).all()
    assert not torch.equal(processed, logits)  # and the input was not modified in place
    assert torch.equal(logits, _logits(len(seqs), vocab=20, seed=4) * 3)

    greedy = [i for i, s in enumerate(seqs) if s.sampling.is_greedy]
    out = sample(logits, seqs, torch.Generator().manual_seed(0))
    assert [out.token_ids[i] for i in greedy] == expected[greedy].argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)  # logprobs stay those of the raw distribution
    chosen = torch.tensor(out.token_ids).unsqueeze(1)
    assert torch.allclose(torch.tensor(out.logprobs), raw.gather(1, chosen).squeeze(1), atol=1e-6)


def test_logit_bias_steers_greedy_and_sampling() -> None:
    logits = torch.zeros(1, 30)
    greedy = sample(logits, [_seq(temperature=0.0, logit_bias=((17, 3.0),))], torch.Generator())
    assert greedy.token_ids == [17]
    assert _support(logits[0], temperature=1.0, logit_bias=((4, 100.0), (9, 100.0))) == {4, 9}
    banned = tuple((t, -100.0) for t in range(30) if t != 8)
    assert _support(logits[0], temperature=1.0, logit_bias=banned) == {8}


def test_min_tokens_masks_eos_until_reached() -> None:
    logits = torch.zeros(1, 20)
    logits[0, 5], logits[0, 7], logits[0, 12] = 10.0, 9.0, 1.0
    eos = frozenset({5, 7})

    def greedy(output: tuple[int, ...]) -> int:
        seq = _seq(output=output, eos=eos, temperature=0.0, min_tokens=2)
        return sample(logits, [seq], torch.Generator()).token_ids[0]

    assert greedy(()) == 12
    assert greedy((3,)) == 12
    assert greedy((3, 4)) == 5
    assert 5 not in _support(logits[0], temperature=1.0, eos=eos, min_tokens=1)
    assert _support(logits[0], temperature=1.0, eos=eos, min_tokens=1).isdisjoint(eos)


def test_top_logprobs_are_the_raw_distributions_top_k() -> None:
    logits = _logits(4, vocab=64, seed=9).to(torch.bfloat16) * 4
    seqs = [
        _seq(temperature=0.0, top_logprobs=3),
        _seq(temperature=0.0),
        _seq(seed=1, temperature=1.0, top_logprobs=20, repetition_penalty=1.5),
        _seq(temperature=0.0, top_logprobs=1, logit_bias=((0, 50.0),)),
    ]
    out = sample(logits, seqs, torch.Generator())
    raw = torch.log_softmax(logits.float(), -1)
    for row, seq in enumerate(seqs):
        k = seq.sampling.top_logprobs
        values, ids = raw[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        got = out.top_logprobs[row]
        assert [t for t, _ in got] == ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in got]), values, atol=1e-6, rtol=0)
    assert out.top_logprobs[0][0] == (out.token_ids[0], out.logprobs[0])  # greedy is the top
    assert out.top_logprobs[1] == []
    assert out.token_ids[3] == 0  # the bias moved the choice, not the reported alternatives
    assert abs(out.logprobs[3] - raw[3, 0].item()) < 1e-6


# -- grammar bitmask ---------------------------------------------------------------------


def _pack(allowed: list[set[int] | None], vocab: int) -> torch.Tensor:
    """bit j of word w = token 32w + j allowed; None = every token."""
    words = math.ceil(vocab / 32)
    rows = []
    for tokens in allowed:
        tokens = set(range(vocab)) if tokens is None else tokens
        row = [sum(1 << (t - 32 * w) for t in tokens if 32 * w <= t < 32 * w + 32)
               for w in range(words)]
        rows.append([v - (1 << 32) if v >= 1 << 31 else v for v in row])  # as int32
    return torch.tensor(rows, dtype=torch.int32)


def test_bitmask_restricts_greedy_and_sampled_tokens() -> None:
    vocab = 70
    logits = _logits(3, vocab=vocab, seed=2)
    allowed = [{3, 31, 33, 64}, None, {0, 40, 63, 69}]
    seqs = [_seq(temperature=0.0), _seq(temperature=0.0), _seq(temperature=0.0)]
    out = sample(logits, seqs, torch.Generator(), bitmask=_pack(allowed, vocab))
    assert out.token_ids[0] == max(allowed[0], key=lambda t: logits[0, t].item())
    assert out.token_ids[1] == logits[1].argmax().item()
    assert out.token_ids[2] == max(allowed[2], key=lambda t: logits[2, t].item())

    draws = 300
    row = torch.zeros(vocab)
    row[[5, 6, 7]] = 8.0  # the likeliest tokens are all disallowed
    seqs = [_seq(seed=i, temperature=1.0) for i in range(draws)]
    mask = _pack([allowed[2]] * draws, vocab)
    sampled = sample(row.expand(draws, -1), seqs, torch.Generator(), bitmask=mask)
    assert set(sampled.token_ids) == allowed[2]


# -- degenerate parameters never produce a token nothing chose ------------------------------


@pytest.mark.parametrize(("temperature", "greedy"), [
    (0.0, True), (1e-6, True), (GREEDY_TEMPERATURE, False), (1e-5, False), (0.5, False),
])
def test_is_greedy_below_the_greedy_temperature(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_a_tiny_temperature_is_greedy() -> None:
    """logits / 1e-39 overflows to inf: the probabilities would be NaN and the draw the last
    token of the vocabulary."""
    logits = _logits(4, vocab=100, seed=3)
    seqs = [_seq(seed=i, temperature=t) for i, t in enumerate((1e-39, 1e-30, 1e-6, 1e-9))]
    assert sample(logits, seqs, torch.Generator()).token_ids == logits.argmax(-1).tolist()


def test_a_tiny_top_p_keeps_the_top_token() -> None:
    logits = _logits(3, vocab=100, seed=4)
    seqs = [_seq(seed=i, temperature=1.0, top_p=p) for i, p in enumerate((1e-50, 1e-45, 1e-9))]
    assert sample(logits, seqs, torch.Generator()).token_ids == logits.argmax(-1).tolist()


def test_a_row_without_any_allowed_token_falls_back_to_the_raw_argmax() -> None:
    vocab = 40
    logits = _logits(2, vocab=vocab, seed=5)
    nothing = torch.zeros(2, math.ceil(vocab / 32), dtype=torch.int32)
    for temperature in (0.0, 1.0):
        seqs = [_seq(seed=1, temperature=temperature) for _ in range(2)]
        out = sample(logits, seqs, torch.Generator(), bitmask=nothing)
        assert out.token_ids == logits.argmax(-1).tolist()


def test_only_the_row_without_an_allowed_token_falls_back() -> None:
    vocab = 40
    logits = _logits(2, vocab=vocab, seed=6)
    mask = torch.zeros(2, math.ceil(vocab / 32), dtype=torch.int32)
    mask[0, 0] = 1 << 3  # row 0 may say token 3 only; row 1 nothing
    out = sample(logits, [_seq(seed=1, temperature=0.0) for _ in range(2)], torch.Generator(),
                 bitmask=mask)
    assert out.token_ids == [3, int(logits[1].argmax())]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_grammar_beats_min_tokens_when_it_allows_only_stop_tokens(
    temperature: float,
) -> None:
    """Row 0's grammar allows only EOS (5) and min_tokens hides it: the grammar wins. Row 1
    keeps other allowed tokens, so min_tokens still hides its EOS."""
    vocab = 40
    logits = _logits(2, vocab=vocab, seed=6)
    logits[:, 5] = -3.0  # EOS is never the raw argmax
    eos = frozenset({5})
    seqs = [_seq(seed=i, eos=eos, min_tokens=4, temperature=temperature) for i in range(2)]
    mask = _pack([{5}, {5, 9, 30}], vocab)
    processed = process_logits(logits.clone(), seqs, mask)
    assert processed[0, 5] == logits[0, 5] and (processed[0] > float("-inf")).sum() == 1
    assert processed[1, 5] == float("-inf") and (processed[1] > float("-inf")).sum() == 2
    out = sample(logits, seqs, torch.Generator(), bitmask=mask)
    assert out.token_ids[0] == 5 and out.token_ids[1] in {9, 30}


def test_logit_bias_and_stop_tokens_become_tensors_once_per_sequence() -> None:
    """Per step, only the rows' tables are joined: no Python list of (row, token) pairs."""
    logits = torch.randn(2, 64)
    bias = tuple((t, 0.5) for t in range(0, 64, 2))
    seqs = [_seq(temperature=0.0, logit_bias=bias),
            _seq(output=(1,), eos=frozenset({2, 13, 99}), min_tokens=4)]
    first = process_logits(logits, seqs)
    tables = (seqs[0].bias_table, seqs[1].stop_table)
    assert tables[0] is not None and tables[0].tokens.tolist() == list(range(0, 64, 2))
    assert tables[1] is not None and tables[1].tokens.tolist() == [2, 13]  # 99: outside
    assert torch.equal(process_logits(logits, seqs), first)
    assert (seqs[0].bias_table, seqs[1].stop_table) == tables  # the same objects, reused
    assert seqs[0].bias_table is tables[0]
