"""Request limits against a real `switchyard serve`-style process (gateway/drain.py's server)
with small limits, through the real openai SDK: each limit is a 4xx naming its field."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.cli import build_parser, settings_from_args
from gateway.settings import Settings
from tests.gateway.drain_server import GatewayProcess

LIMITS = {
    "SWITCHYARD_MAX_REQUEST_BODY_BYTES": "64KiB", "SWITCHYARD_MAX_MESSAGES": "8",
    "SWITCHYARD_MAX_STOP_SEQUENCES": "2", "SWITCHYARD_MAX_STOP_LENGTH": "16",
    "SWITCHYARD_MAX_OUTPUT_TOKENS": "40",
}
HI = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    process = GatewayProcess.start(tmp_path_factory.mktemp("limits"), LIMITS)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0,
                         timeout=20)


def _refused(caught: pytest.ExceptionInfo[openai.APIStatusError], status: int, param: str | None,
             code: str) -> str:
    err = caught.value
    assert err.status_code == status, err.body
    assert err.body["type"] == "invalid_request_error"  # the SDK unwraps {"error": ...}
    assert (err.param, err.code) == (param, code), err.body
    return err.message


def test_a_body_over_the_limit_is_413_naming_the_limit_and_setting(
        client: openai.OpenAI) -> None:
    big = [{"role": "user", "content": "word " * 20_000}]  # ~100 KB, sent with Content-Length
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="slow", messages=big, max_tokens=1)
    message = _refused(caught, 413, None, "request_too_large")
    assert "64 KiB" in message and "--max-request-body-bytes" in message
    near = [{"role": "user", "content": "word " * 12_000}]  # ~60 KB: under the limit
    reply = client.chat.completions.create(model="slow", messages=near, max_tokens=1)
    assert reply.usage.prompt_tokens == 12_000


def test_a_chunked_body_is_counted_as_it_arrives(gateway: GatewayProcess) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "echo", "messages": [{"role": "user", "content": "'
        for _ in range(200):
            yield b"x" * 1024
        yield b'"}]}'

    with httpx.Client(base_url=gateway.url, timeout=20) as http:
        for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
            answer = http.post(path, content=chunks())
            assert answer.status_code == 413, (path, answer.text)
            assert answer.json()["error"]["code"] == "request_too_large"
        small = http.post("/v1/chat/completions", json={"model": "echo", "messages": HI})
        assert small.status_code == 200  # the same connection, or a new one: still serving


def test_too_many_messages(client: openai.OpenAI) -> None:
    many = [{"role": "user", "content": f"m{i}"} for i in range(9)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="echo", messages=many, max_tokens=1)
    assert "maximum length 8" in _refused(caught, 400, "messages", "array_above_max_length")
    assert client.chat.completions.create(model="echo", messages=many[:8], max_tokens=1).choices


def test_too_many_or_too_long_stop_strings(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="echo", messages=HI, stop=["a", "b", "c"])
    _refused(caught, 400, "stop", "array_above_max_length")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="echo", prompt="hi", stop="x" * 17)
    assert "maximum length 16" in _refused(caught, 400, "stop", "string_above_max_length")
    ok = client.completions.create(model="echo", prompt="hi", stop=["x" * 16, "beta"])
    assert ok.choices[0].finish_reason == "stop"


def test_max_tokens_over_the_server_cap_and_over_the_model_context(
        client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="slow", messages=HI, max_tokens=41)
    assert "at most 40" in _refused(caught, 400, "max_tokens", "invalid_value")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="slow", messages=HI, max_completion_tokens=41)
    _refused(caught, 400, "max_completion_tokens", "invalid_value")
    with pytest.raises(openai.BadRequestError) as caught:  # echo's context is 64 tokens
        client.completions.create(model="echo", prompt="w " * 30, max_tokens=40)
    _refused(caught, 400, "max_tokens", "context_length_exceeded")


@pytest.mark.parametrize(("parameters", "message"), [
    ({"stop": ["a", "b", "c"]}, "`stop` supports up to 2 stop sequences. Given: 3"),
    ({"stop": ["x" * 17]}, "`stop` sequences must be at most 16 characters. Given: 17"),
    ({"max_new_tokens": 41}, "`max_new_tokens` must be <= 40. Given: 41"),
])
def test_tgi_limits_in_tgi_shape(gateway: GatewayProcess, parameters: dict,
                                 message: str) -> None:
    answer = httpx.post(f"{gateway.url}/generate", timeout=20,
                        json={"inputs": "hello", "parameters": parameters},
                        headers={"x-model": "echo"})
    assert answer.status_code == 422
    assert answer.json() == {"error": message, "error_type": "validation"}


def test_info_reports_the_limits(gateway: GatewayProcess) -> None:
    info = httpx.get(f"{gateway.url}/info", headers={"x-model": "echo"}, timeout=20).json()
    assert info["max_stop_sequences"] == 2
    assert info["request_limits"] == {
        "max_request_body_bytes": 65536, "max_messages": 8, "max_stop_sequences": 2,
        "max_stop_length": 16, "max_output_tokens": 40, "max_embedding_inputs": 2048}


def test_defaults_and_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in (*LIMITS, "SWITCHYARD_SHUTDOWN_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    limits = Settings().request_limits()
    assert (limits.max_body_bytes, limits.max_messages, limits.max_stop_sequences,
            limits.max_stop_length, limits.max_output_tokens) == (8 * 1024**2, 2048, 4, 512, None)
    assert Settings().shutdown_timeout == 30
    args = build_parser().parse_args([
        "serve", "--payload-limit", "2MiB", "--max-messages", "10", "--max-stop-sequences", "6",
        "--max-stop-length", "100", "--max-output-tokens", "256", "--max-embedding-inputs", "7",
        "--shutdown-timeout", "5"])
    settings = settings_from_args(args)
    assert settings.request_limits().report() == {
        "max_request_body_bytes": 2 * 1024**2, "max_messages": 10, "max_stop_sequences": 6,
        "max_stop_length": 100, "max_output_tokens": 256, "max_embedding_inputs": 7}
    assert settings.shutdown_timeout == 5
