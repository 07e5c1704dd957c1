"""The real engine behind a real uvicorn server, driven by the real openai SDK."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]


@pytest.fixture(scope="module")
def native_backend(tiny_model: Callable[[str], Path]) -> NativeBackend:
    config = EngineConfig(
        model=str(tiny_model("llama_gqa")), served_model_name=MODEL, dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
    )
    return NativeBackend(config)


@pytest.fixture(scope="module")
def base_url(native_backend: NativeBackend) -> Iterator[str]:
    app = create_app(Settings(model_id="unused"), backends={MODEL: native_backend})
    with running_server(app, timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _wait_until_idle(backend: NativeBackend, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = backend.stats()
        if stats.running == 0 and stats.queue_size == 0 and stats.kv_blocks_used == 0:
            break
        time.sleep(0.02)
    engine = backend.engine
    assert engine is not None
    engine.block_manager.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_chat_stream_concatenates_to_the_non_stream_text(client, native_backend) -> None:
    full = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0
    )
    assert full.object == "chat.completion"
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 10
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    _wait_until_idle(native_backend)


def test_completions_and_models(client, native_backend) -> None:
    out = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8,
                                    temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True))
    assert streamed == out.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]
    _wait_until_idle(native_backend)


def test_seed_reproduces_sampling(client) -> None:
    def ask(seed: int) -> str:
        return client.completions.create(
            model=MODEL, prompt="The weather", max_tokens=12, temperature=1.0, seed=seed
        ).choices[0].text

    assert ask(5) == ask(5)


def test_client_errors_raise_the_sdk_classes(client) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    cases = [
        {"max_tokens": 0}, {"temperature": 2.5}, {"top_p": 0}, {"n": 17},
        {"stop": ["a", "b", "c", "d", "e"]}, {"max_tokens": 10_000},
    ]
    for extra in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, **extra)
        assert caught.value.status_code == 400, extra
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10_000,
                                       stream=True)
    assert "context length" in caught.value.message


def test_disconnect_aborts_and_frees_blocks_while_another_completes(
    base_url: str, client, native_backend: NativeBackend
) -> None:
    result: dict[str, object] = {}

    def other() -> None:
        result["out"] = client.completions.create(
            model=MODEL, prompt="A second request", max_tokens=40, temperature=0)

    aborted_before = native_backend.engine.num_aborted
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            worker = threading.Thread(target=other)
            worker.start()
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert native_backend.stats().running >= 1
        # leaving the block closed the connection midway
    worker.join(60)
    assert result["out"].choices[0].finish_reason == "length"
    assert result["out"].usage.completion_tokens == 40
    _wait_until_idle(native_backend)
    assert native_backend.engine.num_aborted == aborted_before + 1


def test_prefix_hit_is_identical_and_shows_in_metrics(base_url: str, client) -> None:
    def hits() -> float:
        text = httpx.get(f"{base_url}/metrics").text
        line = next(x for x in text.splitlines()
                    if x.startswith("switchyard_prefix_cache_hits") and "{" in x)
        return float(line.rsplit(" ", 1)[1])

    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    before = hits()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    middle = hits()
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    assert hits() - middle >= first.usage.prompt_tokens // 8 - 1  # block_size 8
    assert middle >= before
