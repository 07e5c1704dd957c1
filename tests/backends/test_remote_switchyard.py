"""RemoteBackend over a real second Switchyard (the native engine behind real HTTP): `n`
choices and top logprobs pass through and equal the native engine asked directly."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from backends.base import Backend, GenerationEvent
from backends.registry import BackendSpec, create_backend
from tests.backends.conftest import MAX_TOTAL, MODEL
from tests.backends.harness import LoopRunner, Result, collect, request
from tests.backends.recording import Recording

PROMPT = "Once upon a time, in a quiet village"
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]


@pytest.fixture(scope="module")
def remote(
    switchyard_upstream: tuple[str, Recording], tokenizer_dir: Path, runner: LoopRunner,
) -> Iterator[Backend]:
    url, _ = switchyard_upstream
    backend = create_backend(BackendSpec(
        name=MODEL, model_id="unused", backend="remote",
        options={"base_url": url + "/v1", "tokenizer": str(tokenizer_dir),
                 "max_total_tokens": MAX_TOTAL}))
    runner.run(backend.start())
    yield backend
    runner.run(backend.close())


def _choice(result: Result, index: int) -> list[GenerationEvent]:
    return [e for e in result.events if e.index == index]


def _text(events: list[GenerationEvent]) -> str:
    return "".join(e.text for e in events)


@pytest.mark.parametrize("chat", [False, True])
def test_n_seeded_choices_equal_the_native_engines(
    remote: Backend, native_direct: Backend, runner: LoopRunner, chat: bool,
) -> None:
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    req = request(**prompt, max_tokens=10, n=3, temperature=1.0, seed=11, logprobs=True)
    got = runner.run(collect(remote, req))
    want = runner.run(collect(native_direct, req))
    assert {e.index for e in got.events} == {0, 1, 2}
    texts = []
    for k in range(3):
        mine, theirs = _choice(got, k), _choice(want, k)
        assert _text(mine) == _text(theirs)
        assert mine[-1].finish_reason == theirs[-1].finish_reason
        assert mine[-1].usage == theirs[-1].usage  # logprobs listed every token: exact
        texts.append(_text(mine))
    assert len(set(texts)) == 3  # each choice samples with its own seed


@pytest.mark.parametrize("chat", [False, True])
def test_top_logprobs_equal_the_native_engines(
    remote: Backend, native_direct: Backend, runner: LoopRunner, chat: bool,
) -> None:
    prompt = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    req = request(**prompt, max_tokens=6, logprobs=True, top_logprobs=3)
    got = [t for e in runner.run(collect(remote, req)).events for t in e.tokens]
    want = [t for e in runner.run(collect(native_direct, req)).events for t in e.tokens]
    assert [t.text for t in got] == [t.text for t in want]
    assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5)
    for mine, theirs in zip(got, want, strict=True):
        assert len(mine.top_logprobs) == 3
        assert [a.text for a in mine.top_logprobs] == [a.text for a in theirs.top_logprobs]
        assert [a.logprob for a in mine.top_logprobs] == pytest.approx(
            [a.logprob for a in theirs.top_logprobs], abs=1e-5)
