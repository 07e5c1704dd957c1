"""A remote deployment's window and prompt counts, which the gateway reserves a key's tokens by:
the upstream's real window (configured, or read from it, even once it comes up late), an
omitted `max_tokens` sent as the room the prompt leaves (never more than was reserved; for
OpenAI-compatible and TGI upstreams alike), and prompts counted without a tokenizer never
below what a real tokenizer says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import Backend
from backends.registry import BackendSpec, create_backend
from routing.health import probe
from tests.backends.harness import collect, request
from tests.backends.openai_stub import OpenAIStub, create_openai_stub
from tests.backends.tgi_stub import MAX_TOTAL_TOKENS, StubTGI, create_stub_app
from tests.gateway.conftest import running_server

SAMPLES = {
    "english": "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "chinese": "敏捷的棕色狐狸跳过了懒狗。我们明天早上在北京火车站见面，然后一起去吃饭。",
    "japanese": "東京特許許可局の許可証を取得するために、朝早くから並んでいました。",
    "code": "def f(xs):\n    return {k: v**2 for k, v in zip(xs[::2], xs[1::2]) if v != 0}\n",
    "digits": "3.14159265358979323846264338327950288419716939937510582097494459",
    "emoji": "🙂🚀🔥✨🎉 mixed with text 🧪🧬",
}


@pytest.fixture
def stub() -> Iterator[tuple[str, OpenAIStub]]:
    upstream = OpenAIStub()
    with running_server(create_openai_stub(upstream)) as url:
        yield url + "/v1", upstream


@pytest.fixture
def tgi() -> Iterator[tuple[str, StubTGI]]:
    upstream = StubTGI()
    with running_server(create_stub_app(upstream)) as url:
        yield url, upstream


def _remote(base_url: str, **options: Any) -> Backend:
    return create_backend(BackendSpec(
        name="m", model_id="unused", backend="remote",
        options={"base_url": base_url, "model": "stub-model", **options}))


def _tgi(base_url: str, **options: Any) -> Backend:
    return create_backend(BackendSpec(name="m", model_id="unused", backend="tgi",
                                      options={"base_url": base_url, **options}))


async def test_an_omitted_max_tokens_is_sent_as_the_room_the_prompt_leaves(stub) -> None:
    url, upstream = stub
    upstream.max_model_len = None  # the upstream hides its window: 4096 is assumed
    backend = _remote(url)
    await backend.start()
    try:
        chat = request(messages=[{"role": "user", "content": SAMPLES["chinese"]}])
        text = request(SAMPLES["code"], n=2)
        await collect(backend, chat)
        await collect(backend, text)
        asked = request("hi", max_tokens=7)
        await collect(backend, asked)
    finally:
        await backend.close()
    assert backend.info().max_total_tokens == 4096
    sent_chat, sent_text, sent_asked = upstream.requests
    assert sent_chat["max_tokens"] == 4096 - backend.count_tokens(chat)
    assert sent_text["max_tokens"] == 4096 - backend.count_tokens(text)  # per choice
    assert sent_asked["max_tokens"] == 7


async def test_the_configured_max_model_len_is_the_window(stub) -> None:
    url, upstream = stub
    backend = _remote(url, max_model_len=1000)
    await backend.start()
    try:
        req = request("hello there")
        await collect(backend, req)
    finally:
        await backend.close()
    assert backend.info().max_total_tokens == 1000  # over the upstream's 2048
    assert upstream.requests[-1]["max_tokens"] == 1000 - backend.count_tokens(req)


async def test_tgi_is_sent_the_room_the_prompt_leaves_never_a_null_max_new_tokens(
    tgi, tokenizer_dir: Path,
) -> None:
    """A null `max_new_tokens` lets TGI fill the rest of its own window, past what the gateway
    reserved: the backend sends the room left in the window it reserved against."""
    url, upstream = tgi
    estimated, exact = _tgi(url), _tgi(url, tokenizer=str(tokenizer_dir), max_total_tokens=40)
    text = request(SAMPLES["english"])
    chat = request(messages=[{"role": "user", "content": "Tell me a story."}])
    logprobs = request("a b c", prompt_logprobs=0)  # answered whole, by /generate
    for backend, reqs in ((estimated, (text, logprobs)), (exact, (text, chat))):
        await backend.start()
        try:
            for req in reqs:
                await collect(backend, req)
            await collect(backend, request("hi", max_tokens=7))
        finally:
            await backend.close()
    sent = [r["parameters"]["max_new_tokens"] for r in upstream.requests]
    assert estimated.info().max_total_tokens == MAX_TOTAL_TOKENS  # read from /info
    assert exact.info().max_total_tokens == 40  # configured, under the upstream's 64
    assert sent == [MAX_TOTAL_TOKENS - estimated.count_tokens(text),
                    MAX_TOTAL_TOKENS - estimated.count_tokens(logprobs), 7,
                    40 - exact.count_tokens(text), 40 - exact.count_tokens(chat), 7]


async def test_the_window_is_read_once_a_late_upstream_is_up(stub) -> None:
    url, upstream = stub
    upstream.models_status = 503  # down when the gateway starts
    backend = _remote(url)
    await backend.start()
    try:
        assert backend.info().max_total_tokens == 4096
        assert not (await probe(backend, 5)).ready
        upstream.models_status = 200
        assert (await probe(backend, 5)).ready  # the background checker's probe
        assert backend.info().max_total_tokens == 2048
    finally:
        await backend.close()


@pytest.mark.parametrize("sample", list(SAMPLES))
def test_prompts_without_a_tokenizer_are_never_undercounted(
    stub, tokenizer_dir: Path, sample: str,
) -> None:
    url, _ = stub
    estimated = _remote(url)
    exact = _remote(url, tokenizer=str(tokenizer_dir))
    text = request(SAMPLES[sample])
    chat = request(messages=[{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": SAMPLES[sample]}])
    for req in (text, chat):
        assert estimated.count_tokens(req) >= exact.count_tokens(req), sample
    # ... and not wildly over for English: within 2.5x
    if sample == "english":
        assert estimated.count_tokens(text) <= 2.5 * exact.count_tokens(text)
