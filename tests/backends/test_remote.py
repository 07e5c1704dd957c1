"""RemoteBackend against a scripted OpenAI-compatible upstream (real HTTP on a free port)."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from backends.base import (
    Backend,
    DeploymentError,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
    Usage,
)
from backends.registry import BackendSpec, create_backend
from backends.remote.chunks import split_total
from backends.remote.tokenizer import estimate_tokens
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
    upstream[1].mode, upstream[1].delay_s, upstream[1].cached_tokens = "ok", 0.0, None
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
    assert got.usage.completion_tokens == estimate_tokens(WHOLE)
    assert got.usage.completion_tokens >= -(-len(WHOLE) // 4)  # never below 4 chars a token
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


def test_the_upstreams_cached_tokens_pass_through_to_the_sdk(upstream, stub) -> None:
    """OpenAI's prompt_tokens_details.cached_tokens, whole and in the streamed usage chunk;
    0 where the upstream does not say, and never more than the prompt."""
    app = create_app(Settings(model_id="unused"), backends={"m": remote(upstream[0])})
    ask = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

    def cached(client: openai.OpenAI) -> tuple[int, int]:
        whole = client.chat.completions.create(**ask)
        *_, last = client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True})
        return (whole.usage.prompt_tokens_details.cached_tokens,
                last.usage.prompt_tokens_details.cached_tokens)

    with running_server(app) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
        assert cached(client) == (0, 0)
        stub.cached_tokens = 5
        assert cached(client) == (5, 5)
        stub.cached_tokens = 1000  # more than the 7 prompt tokens: a broken upstream
        assert cached(client) == (7, 7)


def _choices(got: Result, n: int) -> list[list[GenerationEvent]]:
    return [[e for e in got.events if e.index == k] for k in range(n)]


@pytest.mark.parametrize("chat", [True, False])
async def test_n_choices_with_top_logprobs_pass_through(upstream, stub, chat) -> None:
    backend = await started(upstream[0])
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    got = await collect(backend, request(**prompt, n=3, logprobs=True, top_logprobs=2))
    await backend.close()
    sent = stub.requests[-1]
    assert sent["n"] == 3
    assert (sent["logprobs"], sent.get("top_logprobs")) == ((True, 2) if chat else (2, None))
    choices = _choices(got, 3)
    assert sum(len(c) for c in choices) == len(got.events)  # every event names its choice
    for k, events in enumerate(choices):
        *deltas, last = events
        assert "".join(e.text for e in deltas) == "".join(PIECES[:len(PIECES) - k])
        assert all(e.finish_reason is None for e in deltas)
        assert last.finish_reason == ("stop" if k == 0 else "length")
        # logprobs listed every token: the upstream's total splits exactly
        assert last.usage == Usage(7, len(PIECES) - k)
        for e in deltas:
            (token,) = e.tokens
            assert token.text == e.text and token.logprob == pytest.approx(-0.1 * (k + 1))
            assert [a.text for a in token.top_logprobs] == [e.text, "alt1"]  # best first
            assert [a.logprob for a in token.top_logprobs] == pytest.approx(
                [-0.1 * (k + 1), -0.1 * (k + 1) - 1])
    assert [e.index for e in got.events if e.finish_reason] == [0, 1, 2]


async def test_n_choices_split_the_upstream_total_by_their_length(upstream, stub) -> None:
    backend = await started(upstream[0])
    got = await collect(backend, request("hi", n=2))
    await backend.close()
    usages = [events[-1].usage for events in _choices(got, 2)]
    assert all(u.prompt_tokens == 7 for u in usages)
    assert sum(u.completion_tokens for u in usages) == 2 * len(PIECES) - 1  # the total, kept
    assert usages[0].completion_tokens >= usages[1].completion_tokens


async def test_an_upstream_answering_fewer_choices_fails_naming_n(upstream, stub) -> None:
    stub.mode = "ignore_n"
    backend = await started(upstream[0])
    with pytest.raises(DeploymentError) as caught:
        await collect(backend, request("hi", n=2))
    await backend.close()
    assert caught.value.status_code == 502 and "1 of the 2 choices" in caught.value.message


def test_splitting_a_total_keeps_it_and_follows_the_weights() -> None:
    assert split_total(10, [3, 3, 4]) == [3, 3, 4]
    assert split_total(11, [1, 1]) in ([6, 5], [5, 6])
    assert split_total(10, [1, 2]) == [3, 7]  # 3.33 / 6.67: the larger remainder gets it
    assert split_total(7, [0, 0, 0]) == [3, 2, 2]
    assert sum(split_total(101, [5, 17, 9])) == 101


async def test_extensions_map_to_vllms_fields(upstream, stub) -> None:
    backend = await started(upstream[0])
    await collect(backend, request("hi", logit_bias=((5, -100.0), (17, 2.5)), min_p=0.1,
                                   min_tokens=3, top_k=4, repetition_penalty=1.2))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for spec in (StructuredOutput("json_object"), StructuredOutput("json_schema",
                                                                   json.dumps(schema)),
                 StructuredOutput("regex", "[ab]+"), StructuredOutput("lark", "start: \"x\""),
                 StructuredOutput("json_schema", json.dumps(schema), name="thing",
                                  strict=False)):
        await collect(backend, request(messages=[{"role": "user", "content": "hi"}],
                                       structured=spec))
    await backend.close()
    extended, as_object, as_schema, as_regex, as_lark, as_named = stub.requests
    assert extended["logit_bias"] == {"5": -100.0, "17": 2.5}
    assert (extended["min_p"], extended["min_tokens"], extended["top_k"],
            extended["repetition_penalty"]) == (0.1, 3, 4, 1.2)
    assert "n" not in extended and "response_format" not in extended
    assert as_object["response_format"] == {"type": "json_object"}
    assert as_schema["response_format"] == {"type": "json_schema", "json_schema": {
        "name": "response", "schema": schema, "strict": True}}
    assert as_regex["structured_outputs"] == {"regex": "[ab]+"}
    assert as_lark["structured_outputs"] == {"grammar": "start: \"x\""}
    assert as_named["response_format"]["json_schema"] == {  # the client's name and strict
        "name": "thing", "schema": schema, "strict": False}


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools", "tool calls through remote deployments"),
    ({"sampling": SamplingParams(prompt_logprobs=1)}, "prompt_logprobs", "remote"),
])
async def test_what_the_wire_cannot_carry_is_refused_before_asking(
    upstream, stub, extra, param, words,
) -> None:
    backend = await started(upstream[0])
    req = GenerationRequest(request_id="refused", messages=[{"role": "user", "content": "hi"}],
                            **extra)
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(req))
    await backend.close()
    assert caught.value.status_code == 400 and caught.value.param == param
    assert words in caught.value.message and not stub.requests


async def test_detokenize_needs_the_tokenizer_option(upstream, tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).encode(
        "<|im_start|>Hello world").ids
    with_tokenizer = remote(upstream[0], tokenizer=str(tokenizer_dir))
    assert with_tokenizer.detokenize(ids) == "<|im_start|>Hello world"  # specials kept
    with pytest.raises(RequestError) as outside:
        with_tokenizer.detokenize([10**7])
    assert outside.value.param == "tokens"
    with pytest.raises(RequestError) as without:
        remote(upstream[0]).detokenize(ids)
    assert without.value.status_code == 400 and "`tokenizer`" in without.value.message
