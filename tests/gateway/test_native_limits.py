"""Bounded waiting, deadlines and failure isolation of the real engine, over a real uvicorn
server, through the real openai SDK (and raw httpx where the bytes matter)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.test_native_http import _wait_until_idle

MODEL = "tiny-llama"


def _prompts(count: int, length: int = 12, seed: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (length + i,), generator=gen).tolist() for i in range(count)]


@contextmanager
def _serve(path: Path, step_delay: float = 0.0, **options: Any,
           ) -> Iterator[tuple[str, NativeBackend]]:
    config = EngineConfig(
        model=str(path), served_model_name=MODEL, dtype="float32", max_total_tokens=256,
        max_batch_total_tokens=2048, block_size=8, compile=False, **options,
    )
    backend = NativeBackend(config)
    app = create_app(Settings(model_id="unused"), backends={MODEL: backend})
    with running_server(app, timeout_s=120) as url:
        engine = backend.engine
        assert engine is not None
        if step_delay:  # a slow model: steps long enough for requests to queue up
            run = engine.runner.run

            def slow(batch, greedy=False):  # type: ignore[no-untyped-def]
                time.sleep(step_delay)
                return run(batch, greedy)

            engine.runner.run = slow  # type: ignore[method-assign]
        yield url, backend


@pytest.fixture(scope="module")
def path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


def _client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def _first_chunk(stream: Any) -> Any:
    return await anext(aiter(stream))


async def _until(check: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_full_queue_gets_429_with_retry_after(path: Path) -> None:
    """One sequence runs, two may wait; beyond that (or beyond 40 waiting prompt tokens):
    429 `overloaded` with a Retry-After, raised by the SDK as RateLimitError."""
    with _serve(path, step_delay=0.03, max_batch_size=1, max_queued_requests=2,
                max_queued_tokens=40) as (url, backend):
        client = _client(url)
        short, long_ = _prompts(1, 8)[0], _prompts(1, 30, seed=4)[0]

        def complete(prompt: list[int], tokens: int = 40) -> Any:
            return client.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens,
                                             temperature=0, stream=True)

        async def main() -> None:
            running = await complete(short, 60)
            await _first_chunk(running)
            waiting = asyncio.ensure_future(complete(short))  # 8 tokens wait
            await _until(lambda: len(backend._waiting) == 1)
            with pytest.raises(openai.RateLimitError) as by_tokens:  # 8 + 30 + ... > 40
                await complete(long_ + long_[:5])
            second = asyncio.ensure_future(complete(short))  # 16 tokens, 2 waiting: fits
            await _until(lambda: len(backend._waiting) == 2)
            with pytest.raises(openai.RateLimitError) as by_count:
                await complete(short)
            for caught in (by_tokens.value, by_count.value):
                assert caught.code == "overloaded"
                assert int(caught.response.headers["retry-after"]) >= 1
            assert "--max-queued-tokens" in by_tokens.value.message
            assert "--max-queued-requests" in by_count.value.message
            for stream in (running, await waiting, await second):
                async for _ in stream:
                    pass
            await client.close()

        asyncio.run(main())
        _wait_until_idle(backend)
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, "switchyard_queue_rejections_total", limit="requests") == 1
        assert _metric(metrics, "switchyard_queue_rejections_total", limit="tokens") == 1
        info = httpx.get(f"{url}/info").json()
        assert (info["max_queued_requests"], info["max_queued_tokens"]) == (2, 40)


def test_the_sdk_waits_out_retry_after_then_gets_its_answer(path: Path) -> None:
    """A client with retries on (the SDK's default) meets a full queue: the SDK waits the
    server's Retry-After before it asks again, and the retry is served once the queue drains."""
    with _serve(path, step_delay=0.03, max_batch_size=1, max_queued_requests=1) as (url,
                                                                                     backend):
        seen: list[tuple[float, int, str | None]] = []

        async def record(response: httpx.Response) -> None:
            seen.append((time.monotonic(), response.status_code,
                         response.headers.get("retry-after")))

        http = httpx.AsyncClient(event_hooks={"response": [record]})
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=3,
                                    http_client=http)
        prompt = _prompts(1, 8)[0]

        plain = _client(url)

        def stream(tokens: int) -> Any:
            return plain.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens,
                                             temperature=0, stream=True)

        async def main() -> Any:
            running = await stream(30)
            waiting = asyncio.ensure_future(stream(30))
            await _until(lambda: len(backend._waiting) == 1)  # the queue is full
            answer = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                                     temperature=0)
            for busy in (running, await waiting):
                async for _ in busy:
                    pass
            await client.close()
            await plain.close()
            return answer

        answer = asyncio.run(main())
        assert len(answer.choices[0].text) > 0 and answer.usage.completion_tokens == 4
        refused = [i for i, (_, status, _) in enumerate(seen) if status == 429]
        assert refused, "the queue was never full"
        for i in refused:  # every retry came no sooner than the Retry-After it was told
            sent_at, _, retry_after = seen[i]
            assert retry_after is not None and int(retry_after) >= 1
            assert seen[i + 1][0] - sent_at >= int(retry_after) - 0.05
        assert seen[-1][1] == 200


def test_queue_and_request_timeouts(path: Path) -> None:
    """A request still waiting after --queue-timeout gets 503 before any byte, streamed or
    not; one running past --request-timeout ends: a stream with an error event (no finish
    chunk) then [DONE], a whole answer with 504."""
    with _serve(path, step_delay=0.05, max_batch_size=1, queue_timeout=0.3,
                request_timeout=2.5) as (url, backend):
        body = {"model": MODEL, "prompt": _prompts(1)[0], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{url}/v1/completions", json=body) as running:
                assert running.status_code == 200
                lines = running.iter_lines()
                assert next(lines).startswith("data: ")  # it runs: the others must wait
                started = time.monotonic()
                queued = http.post(f"{url}/v1/completions", json=body)
                whole = http.post(f"{url}/v1/completions", json={**body, "stream": False})
                for answer in (queued, whole):
                    assert answer.status_code == 503, answer.text
                    assert answer.headers["content-type"].startswith("application/json")
                    assert answer.json()["error"]["code"] == "queue_timeout"
                    assert int(answer.headers["retry-after"]) >= 1
                assert time.monotonic() - started < 2.5
                events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == "request_timeout" and "--request-timeout" in error["message"]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
        assert chunks and all(c["choices"][0]["finish_reason"] is None for c in chunks)

        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as caught:
            client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=200,
                                      temperature=0, extra_body={"ignore_eos": True})
        assert caught.value.status_code == 504 and caught.value.code == "request_timeout"
        with pytest.raises(openai.APIError, match="request timeout"):
            for _ in client.completions.create(model=MODEL, prompt=body["prompt"],
                                               max_tokens=200, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True}):
                pass
        _wait_until_idle(backend)
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, "switchyard_request_timeouts_total", kind="queue") == 2
        assert _metric(metrics, "switchyard_request_timeouts_total", kind="total") == 3
        info = httpx.get(f"{url}/info").json()
        assert (info["queue_timeout"], info["request_timeout"]) == (0.3, 2.5)


def test_a_fault_in_one_request_of_eight_fails_only_that_request(path: Path) -> None:
    prompts = _prompts(8)
    with _serve(path, step_delay=0.02) as (url, backend):
        engine = backend.engine
        assert engine is not None

        async def one(client: openai.AsyncOpenAI, prompt: list[int]) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        async def main(fault_on: int | None) -> list[str | BaseException]:
            client = _client(url)
            tasks = [asyncio.ensure_future(one(client, p)) for p in prompts]
            if fault_on is not None:
                await _until(lambda: len(engine.scheduler.running) == 8)
                groups = dict(engine._groups)
                (rid,) = [r for r, c in groups.items()
                          if c and c[0].prompt_token_ids == prompts[fault_on]]
                faulty.append(rid)
                engine.faults.add(rid)
            try:
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await client.close()

        faulty: list[str] = []
        expected = asyncio.run(main(None))
        _wait_until_idle(backend)
        got = asyncio.run(main(3))
        engine.faults.clear()
        error = got[3]
        assert isinstance(error, openai.APIError) and faulty[0] in error.message, error
        assert got[:3] + got[4:] == expected[:3] + expected[4:]
        assert all(isinstance(text, str) and text for text in expected)
        _wait_until_idle(backend)  # every KV block free, block manager consistent
        metrics = httpx.get(f"{url}/metrics").text
        assert _metric(metrics, "switchyard_engine_step_failures_total") >= 2
        assert _metric(metrics, "switchyard_engine_failed_requests_total") == 1


class _EngineKilled(BaseException):
    pass


def test_a_dead_engine_thread_turns_health_503(path: Path, caplog: pytest.LogCaptureFixture,
                                               ) -> None:
    with _serve(path) as (url, backend):
        assert httpx.get(f"{url}/health").status_code == 200
        engine = backend.engine
        assert engine is not None

        def die() -> list[Any]:
            raise _EngineKilled("simulated crash")

        engine.step = die  # type: ignore[method-assign]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with caplog.at_level(logging.ERROR, logger="backends.native.backend"):
            with pytest.raises(openai.APIStatusError) as caught:
                client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
            assert caught.value.status_code == 503
            health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert "engine thread" in json.dumps(health.json())
        assert "the engine thread died" in caplog.text and "simulated crash" in caplog.text
        assert any(r.exc_info for r in caplog.records if "engine thread died" in r.message)
        with pytest.raises(openai.APIStatusError) as again:
            client.completions.create(model=MODEL, prompt="Hello", max_tokens=4)
        assert again.value.status_code == 503


async def _stream_gap_s(client: openai.AsyncOpenAI, bias: dict[str, float] | None) -> list[float]:
    """Gaps between one greedy stream's tokens while a 16-choice request (with `bias`, or
    none) decodes beside it."""
    prompt_a, prompt_b = _prompts(2, seed=11)
    heavy = asyncio.create_task(client.completions.create(
        model=MODEL, prompt=prompt_a, n=16, max_tokens=150, temperature=1.0, seed=5,
        logit_bias=bias, extra_body={"ignore_eos": True}))  # type: ignore[arg-type]
    await asyncio.sleep(0.5)  # its prompt is in: its 16 rows decode every step
    stream = await client.completions.create(model=MODEL, prompt=prompt_b, max_tokens=40,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    times = [time.perf_counter() async for _ in stream]
    assert not heavy.done(), "the 16-choice request ended before the stream: no overlap"
    await heavy
    return [b - a for a, b in zip(times[2:], times[3:], strict=False)]


def test_a_large_logit_bias_leaves_another_streams_latency_alone(path: Path) -> None:
    """The largest logit_bias allowed (1024 entries) with n=16 costs the other stream's
    inter-token time at most 1.5x what the same request without a bias does (the bias is
    one tensor made once, not 16k Python tuples a step)."""
    bias = {str(token): -5.0 for token in range(3, 3 + 1024)}

    async def run(url: str) -> tuple[float, float]:
        client = _client(url)
        plain: list[float] = []
        biased: list[float] = []
        for _ in range(3):  # interleaved, so a noisy neighbour hits both alike
            plain += await _stream_gap_s(client, None)
            biased += await _stream_gap_s(client, bias)
        return sorted(plain)[len(plain) // 2], sorted(biased)[len(biased) // 2]

    with _serve(path) as (url, _):
        plain, biased = asyncio.run(run(url))
    assert biased <= 1.5 * plain, f"median gap {biased * 1e3:.1f} ms with the bias, " \
                                  f"{plain * 1e3:.1f} ms without"
