"""The Backend contract, the same tests over every backend in conftest.CASES."""

from __future__ import annotations

from dataclasses import replace

import pytest

from backends.base import RequestError, Usage
from tests.backends.conftest import Case
from tests.backends.harness import Result, request, wait_for

PROMPT = "Once upon a time, in a quiet village"
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]


def assert_same(got: Result, want: Result, case: Case) -> None:
    assert got.text == want.text
    assert got.last.finish_reason == want.last.finish_reason
    # The prefix cache's share of the prompt depends on what each backend served before.
    assert _uncached(got.usage) == _uncached(want.usage)
    if case.exact_token_ids:
        assert got.token_ids == want.token_ids


def _uncached(usage: Usage | None) -> Usage | None:
    return None if usage is None else replace(usage, cached_tokens=0)


def test_greedy_text_ids_and_usage_equal_the_reference(case: Case) -> None:
    req = request(PROMPT, max_tokens=16)
    got = case.collect(req)
    assert_same(got, case.reference(req), case)
    assert got.usage is not None and got.usage.completion_tokens <= 16


def test_chat_equals_the_reference(case: Case) -> None:
    req = request(messages=MESSAGES, max_tokens=12)
    assert_same(case.collect(req), case.reference(req), case)


def test_only_the_last_event_finishes_and_it_carries_usage(case: Case) -> None:
    got = case.collect(request(PROMPT, max_tokens=10))
    assert len(got.events) >= 2
    assert all(e.finish_reason is None and e.usage is None for e in got.events[:-1])
    assert got.last.finish_reason in ("stop", "length") and got.usage is not None
    assert got.usage.prompt_tokens > 0


def test_streamed_deltas_concatenate_to_the_whole_answer(case: Case) -> None:
    got = case.collect(request(PROMPT, max_tokens=16))
    assert got.text == "".join(e.text for e in got.events)
    assert [e.text for e in got.events if e.text] and len(got.events) > 2  # not one lump


def test_max_tokens_ends_with_length(case: Case) -> None:
    got = case.collect(request(PROMPT, max_tokens=5))
    assert got.last.finish_reason == "length"
    assert got.usage is not None and got.usage.completion_tokens == 5


def test_a_stop_sequence_ends_the_answer_before_it(case: Case) -> None:
    whole = case.reference(request(PROMPT, max_tokens=16)).text
    cut = len(whole) // 2
    stop = whole[cut:cut + 3]
    assert stop.strip(), whole
    cut = whole.find(stop)
    req = request(PROMPT, max_tokens=16, stop=(stop,))
    got = case.collect(req)
    assert got.text == whole[:cut]
    assert got.last.finish_reason == "stop"
    if case.knows_stop_reason:
        assert got.last.stop_reason == "stop_sequence"
        assert got.last.stop_sequence == stop  # which stop (Anthropic's stop_sequence)
    assert_same(got, case.reference(req), case)


def test_a_prompt_too_long_is_refused_before_the_first_event(case: Case) -> None:
    events = case.backend.generate(request("hello " * (case.max_total_tokens + 10)))
    with pytest.raises(RequestError) as caught:
        case.run(anext(events))
    assert 400 <= caught.value.status_code < 500
    case.run(events.aclose())


def test_aclose_mid_stream_frees_the_request(case: Case) -> None:
    closed_before = case.closed_upstream() if case.closed_upstream else 0
    events = case.backend.generate(request(PROMPT, max_tokens=case.max_total_tokens // 2))
    first = case.run(anext(events))
    second = case.run(anext(events))
    assert first.finish_reason is None and second.finish_reason is None
    case.run(events.aclose())
    assert wait_for(case.idle), case.backend.stats()
    if case.closed_upstream is not None:
        assert wait_for(lambda: case.closed_upstream() == closed_before + 1)


def test_count_tokens_matches_the_usage(case: Case) -> None:
    req = request(PROMPT, max_tokens=4)
    counted = case.backend.count_tokens(req)
    if case.exact_counts:
        assert counted == case.reference(req).usage.prompt_tokens
    assert counted > 0


def test_health_is_ready(case: Case) -> None:
    health = case.run(case.backend.health())
    assert health.ready, health.detail


def test_info_names_the_model_and_its_limits(case: Case) -> None:
    info = case.backend.info()
    assert info.name == "tiny" and info.backend == case.kind
    assert info.max_total_tokens == case.max_total_tokens
    assert 0 < info.max_input_tokens < info.max_total_tokens
