"""What a remote upstream may send is bounded: lines, events, whole bodies, connections, time,
and the counts it bills. Each against the scripted upstream on a real port."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from backends.base import Backend, DeploymentError, RequestError
from backends.registry import BackendSpec, create_backend
from backends.remote.http import retry_after
from tests.backends.harness import collect, request
from tests.backends.openai_stub import HUGE_BYTES, PIECES, OpenAIStub, create_openai_stub
from tests.gateway.conftest import running_server


@pytest.fixture
def stub() -> Iterator[tuple[str, OpenAIStub]]:
    upstream = OpenAIStub()
    with running_server(create_openai_stub(upstream)) as url:
        yield url + "/v1", upstream


async def _started(base_url: str, **options: Any) -> Backend:
    backend = create_backend(BackendSpec(
        name="m", model_id="unused", backend="remote",
        options={"base_url": base_url, "model": "stub-model", **options}))
    await backend.start()
    return backend


async def test_an_endless_stream_line_is_cut_at_the_line_limit(stub) -> None:
    url, upstream = stub
    upstream.mode = "endless_line"
    backend = await _started(url, max_sse_line_bytes=64 * 1024)
    try:
        with pytest.raises(DeploymentError) as caught:
            await collect(backend, request("hi"))
    finally:
        await backend.close()
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_too_large")
    assert "65536 bytes" in caught.value.message
    assert upstream.sent_bytes < 16 * 2**20  # read stopped near the limit, not at the end


async def test_a_huge_whole_answer_is_cut_at_the_body_limit(stub) -> None:
    url, upstream = stub
    upstream.mode = "huge_json"
    backend = await _started(url)  # the default: 16 MiB
    try:
        with pytest.raises(DeploymentError) as caught:
            await collect(backend, request(messages=[{"role": "user", "content": "hi"}]))
    finally:
        await backend.close()
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_too_large")
    assert upstream.sent_bytes < HUGE_BYTES // 2


async def test_negative_upstream_usage_is_clamped_to_zero(stub) -> None:
    url, upstream = stub
    upstream.mode = "negative_usage"
    backend = await _started(url)
    try:
        got = await collect(backend, request("hi", max_tokens=8))
    finally:
        await backend.close()
    assert got.text == "".join(PIECES)
    assert got.usage.prompt_tokens == 0 and got.usage.completion_tokens == 0


async def test_connections_to_an_upstream_are_capped(stub) -> None:
    url, upstream = stub
    upstream.delay_s = 0.05
    backend = await _started(url, max_connections=2)
    try:
        results = await asyncio.gather(*(collect(backend, request("hi", max_tokens=8))
                                         for _ in range(6)))
    finally:
        await backend.close()
    assert all(r.text == "".join(PIECES) for r in results)  # the others waited their turn
    assert upstream.peak == 2


async def test_a_request_past_its_total_duration_stops_as_its_own_timeout(stub) -> None:
    url, upstream = stub
    upstream.delay_s = 0.5  # six pieces: 3 s, with never more than 0.5 s between bytes
    backend = await _started(url, read_timeout=2, request_timeout=1.2)
    try:
        got: list[str] = []
        with pytest.raises(RequestError) as caught:
            async for event in backend.generate(request("hi", max_tokens=8)):
                got.append(event.text)
    finally:
        await backend.close()
    assert (caught.value.status_code, caught.value.code) == (504, "request_timeout")
    assert "request_timeout" in caught.value.message
    assert 0 < len(got) < len(PIECES)


@pytest.mark.parametrize(("value", "seconds"), [
    ("7", 7.0), ("inf", None), ("-inf", None), ("nan", None), ("1e999", None),
    ("soon", None), ("-3", 0.0), ("99999999", 3600.0), ("Wed, 99 Foo 2026 00:00:00 GMT", None),
    ("Fri, 31 Dec 9999 23:59:59 GMT", 3600.0),
])
def test_retry_after_is_read_defensively(value: str, seconds: float | None) -> None:
    assert retry_after({"retry-after": value}) == seconds
