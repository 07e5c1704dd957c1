"""RemoteBackend against a scripted OpenAI-compatible upstream (real HTTP on a free port)."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.base import Backend, DeploymentError, RequestError
from backends.registry import BackendSpec, create_backend
from gateway.app import create_app
from gateway.settings import Settings
from tests.backends.harness import Result, collect, request
from tests.backends.openai_stub import PIECES, OpenAIStub, create_openai_stub
from tests.gateway.conftest import running_server

WHOLE = "".join(PIECES)


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, OpenAIStub]]:
    stub = OpenAIStub()
    with running_server(create_openai_stub(stub)) as url:
        yield url + "/v1", stub


@pytest.fixture
def stub(upstream: tuple[str, OpenAIStub]) -> OpenAIStub:
    upstream[1].mode, upstream[1].delay_s = "ok", 0.0
    upstream[1].requests.clear()
    upstream[1].headers.clear()
    return upstream[1]


def remote(base_url: str, **options: Any) -> Backend:
    spec = BackendSpec(name="m", model_id="unused", backend="remote",
                       options={"base_url": base_url, "model": "stub-model", **options})
    return create_backend(spec)


async def started(base_url: str, **options: Any) -> Backend:
    backend = remote(base_url, **options)
    await backend.start()
    return backend


async def test_streams_chat_and_completions_with_upstream_usage(upstream, stub) -> None:
    backend = await started(upstream[0])
    chat = await collect(backend, request(messages=[{"role": "user", "content": "hi"}]))
    text = await collect(backend, request("hi", max_tokens=9, top_k=5, seed=3))
    await backend.close()
    for got in (chat, text):
        assert [e.text for e in got.events[:-1]] == list(PIECES)
        assert got.last.finish_reason == "stop" and got.usage.prompt_tokens == 7
    sent_chat, sent_text = stub.requests
    assert sent_chat["stream"] is True and sent_chat["stream_options"] == {"include_usage": True}
    assert sent_chat["messages"] == [{"role": "user", "content": "hi"}]
    assert sent_chat["model"] == "stub-model" and sent_chat["temperature"] == 0.0
    assert sent_text["prompt"] == "hi" and sent_text["max_tokens"] == 9
    assert sent_text["top_k"] == 5 and sent_text["seed"] == 3 and "top_p" not in sent_text
    assert backend.info().max_total_tokens == 2048  # the upstream's max_model_len


async def test_the_upstream_key_comes_from_the_named_env_var(upstream, stub, monkeypatch) -> None:
    monkeypatch.setenv("STUB_KEY", "sk-upstream-123")
    backend = await started(upstream[0], api_key_env="STUB_KEY")
    monkeypatch.setenv("STUB_KEY", "changed-later")  # read when the backend was created
    await collect(backend, request("hi"))
    await backend.close()
    assert stub.headers[-1]["authorization"] == "Bearer sk-upstream-123"


def test_a_missing_key_variable_or_bad_option_fails_startup_naming_it(monkeypatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    with pytest.raises(ValueError, match="NO_SUCH_KEY"):
        remote("http://x/v1", api_key_env="NO_SUCH_KEY")
    with pytest.raises(ValueError, match="colour"):
        remote("http://x/v1", colour="red")
    with pytest.raises(ValueError, match="read_timeout"):
        remote("http://x/v1", read_timeout=-1)
    with pytest.raises(ValueError, match="base_url"):
        remote("ftp://x")
    with pytest.raises(ValueError, match="tokenizer"):
        remote("http://x/v1", tokenizer="/no/such/folder")


async def test_an_upstream_4xx_passes_through(upstream, stub) -> None:
    stub.mode = "status:400"
    backend = await started(upstream[0])
    with pytest.raises(RequestError) as caught:
        await collect(backend, request("hi"))
    await backend.close()
    err = caught.value
    assert (err.status_code, err.message, err.param, err.code) == (
        400, "stub says 400", "temperature", "stub_code")


@pytest.mark.parametrize(("mode", "status", "code"), [
    ("status:500", 502, "upstream_error"), ("status:503", 502, "upstream_error"),
    ("status:429", 429, "upstream_rate_limited"), ("status:401", 502, "upstream_auth"),
    ("hang", 504, "upstream_timeout"),
])
async def test_upstream_failures_raise_before_any_event(upstream, stub, mode, status, code) -> None:
    stub.mode = mode
    backend = await started(upstream[0], read_timeout=0.5)
    events = backend.generate(request("hi"))
    with pytest.raises(DeploymentError) as caught:
        await anext(events)
    await backend.close()
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert caught.value.retry_after == (7.0 if status == 429 else None)
    if mode == "status:500":
        assert "stub says 500" in caught.value.message


async def test_connection_refused_is_502_unreachable() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    backend = await started(f"http://127.0.0.1:{port}/v1", connect_timeout=1)
    with pytest.raises(DeploymentError) as caught:
        await anext(backend.generate(request("hi")))
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_unreachable")
    assert not (await backend.health()).ready
    await backend.close()


async def test_a_broken_http_answer_never_shows_the_upstream_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """aiohttp's ClientResponseError carries the request headers in its repr."""
    async def answer_garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer_garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("UPSTREAM_SECRET", "sk-never-show-me")
    backend = await started(f"http://127.0.0.1:{port}/v1", api_key_env="UPSTREAM_SECRET")
    try:
        with pytest.raises(DeploymentError) as caught:
            await anext(backend.generate(request("hi")))
        assert caught.value.status_code == 502
        assert "sk-never-show-me" not in caught.value.message
    finally:
        await backend.close()
        server.close()


@pytest.mark.parametrize("mode", ["malformed", "no_choices"])
async def test_a_malformed_answer_is_502(upstream, stub, mode) -> None:
    stub.mode = mode
    backend = await started(upstream[0])
    got = Result()
    with pytest.raises(DeploymentError) as caught:
        async for event in backend.generate(request("hi")):
            got.events.append(event)
    await backend.close()
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_malformed")
    assert got.text == PIECES[0]  # failures after events come from the iterator


async def test_an_upstream_dying_mid_stream_fails_after_its_events(upstream, stub) -> None:
    stub.mode = "die"
    backend = await started(upstream[0])
    got = Result()
    with pytest.raises(DeploymentError) as caught:
        async for event in backend.generate(request("hi")):
            got.events.append(event)
    await backend.close()
    assert got.text == "".join(PIECES[:2]) and all(e.finish_reason is None for e in got.events)
    assert caught.value.status_code == 502


async def test_a_non_streamed_answer_is_still_read(upstream, stub) -> None:
    stub.mode = "json"
    backend = await started(upstream[0])
    got = await collect(backend, request(messages=[{"role": "user", "content": "hi"}]))
    await backend.close()
    assert got.text == WHOLE and got.last.finish_reason == "length"


async def test_refused_stream_options_fall_back_to_the_tokenizer(
    upstream, stub, tokenizer_dir: Path,
) -> None:
    from tokenizers import Tokenizer

    stub.mode = "no_stream_options"
    backend = await started(upstream[0], tokenizer=str(tokenizer_dir))
    assert backend.info().extra["usage_source"] == "upstream"
    got = await collect(backend, request("Once upon a time"))
    again = await collect(backend, request("Once upon a time"))
    await backend.close()
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert got.text == WHOLE and got.usage == again.usage
    assert got.usage.completion_tokens == len(tok.encode(WHOLE, add_special_tokens=False).ids)
    assert got.usage.prompt_tokens == len(tok.encode("Once upon a time").ids)
    assert backend.info().extra["usage_source"] == "tokenizer"
    assert [("stream_options" in r) for r in stub.requests] == [True, False, False]


async def test_without_a_tokenizer_usage_is_estimated_and_says_so(upstream, stub) -> None:
    stub.mode = "no_stream_options"
    backend = await started(upstream[0])
    got = await collect(backend, request("Once upon a time"))
    await backend.close()
    assert got.usage.completion_tokens == -(-len(WHOLE) // 4)
    assert backend.info().extra["usage_source"] == "estimate"


def test_importing_the_http_backends_loads_no_torch(tokenizer_dir: Path) -> None:
    import subprocess

    code = ("import sys; import backends.remote.backend, backends.tgi.backend; "
            "from backends.remote.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(tokenizer_dir)!r}).render_chat([{{'role': 'user', "
            "'content': 'hi'}], True); assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_through_a_gateway_errors_reach_the_sdk_in_openai_shape(upstream, stub) -> None:
    app = create_app(Settings(model_id="unused"), backends={"m": remote(upstream[0])})
    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        answer = client.chat.completions.create(**ask)
        assert answer.choices[0].message.content == WHOLE
        stub.mode = "status:429"
        with pytest.raises(openai.RateLimitError) as limited:
            client.chat.completions.create(**ask)
        assert limited.value.response.headers["retry-after"] == "7"
        stub.mode = "status:400"
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**ask, stream=True)
        assert bad.value.code == "stub_code" and bad.value.param == "temperature"
        stub.mode = "status:500"
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(**ask)
        assert failed.value.status_code == 502
        stub.mode = "die"
        with pytest.raises(openai.APIError):
            for _ in client.chat.completions.create(**ask, stream=True):
                pass
