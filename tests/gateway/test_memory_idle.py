"""After a burst of mixed requests through a real server (finished, streamed, cut off by the
client mid-stream, failed by the engine, refused), every KV block is free and every
per-request container in the gateway, auth, routing, backend and engine is empty again."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from auth.memory_limiter import MemoryLimiter
from auth.policy import KeyAccess
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, admin_headers
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
DOOMED = [7, 7, 7, 7, 7]  # a prompt starting so fails in the engine (the test's fault hook)
MESSAGES = [{"role": "user", "content": "Tell me about the sea and the ships on it."}]
LONG = {"max_tokens": 120, "ignore_eos": True, "temperature": 0}
# A label value that names one request or one key would grow the series without bound.
PER_REQUEST = re.compile(r"[0-9a-f]{16,}|(chatcmpl-|cmpl-|key_).*")


@pytest.fixture(scope="module")
def served(tiny_model: Callable[[str], Path]) -> Iterator[tuple[str, Any, NativeBackend]]:
    config = EngineConfig(
        model=str(tiny_model("llama_gqa")), served_model_name=MODEL, dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=8, compile=False,
        max_batch_size=8, max_concurrent_requests=24,
    )
    backend = NativeBackend(config)
    app = create_app(Settings(model_id="unused", admin_key=ADMIN_KEY),
                     backends={MODEL: backend})
    with running_server(app, timeout_s=120) as url:
        engine = backend.engine
        assert engine is not None
        _doom_marked_prompts(engine)
        yield url, app, backend


def _doom_marked_prompts(engine: LLMEngine) -> None:
    add = engine.add_request

    def add_request(request_id: str, prompt: list[int], *args: Any, **kwargs: Any) -> Any:
        if prompt[: len(DOOMED)] == DOOMED:
            engine.faults.add(request_id)
        return add(request_id, prompt, *args, **kwargs)

    engine.add_request = add_request  # type: ignore[method-assign]


async def _whole(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    response = await http.post(path, json=body)
    return str(response.status_code)


async def _stream(http: httpx.AsyncClient, path: str, body: dict[str, Any],
                  cut_after: int | None = None) -> str:
    """Read the stream to its end, or leave after `cut_after` lines (the client disconnects)."""
    async with http.stream("POST", path, json=body) as response:
        lines = 0
        async for line in response.aiter_lines():
            lines += bool(line)
            if cut_after is not None and lines >= cut_after:
                return "cut"
        return str(response.status_code)


async def _hang_up(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str:
    """A non-streamed request whose client gives up before the answer (or its status, when
    the server answered first: a busy server may refuse it at once with a 429)."""
    try:
        response = await http.post(path, json=body, timeout=0.25)
    except httpx.TimeoutException:
        return "hung up"
    return str(response.status_code)


def _burst(http: httpx.AsyncClient) -> list[Any]:
    chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8}
    tgi = {"inputs": "The sea is", "parameters": {"max_new_tokens": 8}}
    calls = []
    for i in range(3):
        calls += [
            _whole(http, "/v1/chat/completions", chat),
            _stream(http, "/v1/chat/completions", {**chat, "stream": True}),
            _whole(http, "/v1/completions", {"model": MODEL, "prompt": [5 + i, 9, 11, 40],
                                             "max_tokens": 6, "n": 2, "temperature": 1.0}),
            _whole(http, "/generate", tgi),
            _stream(http, "/generate_stream", tgi),
            _stream(http, "/v1/chat/completions", {**chat, **LONG, "stream": True}, 3),
            _stream(http, "/generate_stream",
                    {"inputs": "Waves", "parameters": {"max_new_tokens": 120}}, 2),
            _stream(http, "/v1/completions", {"model": MODEL, "prompt": [3, 4, 5, 6, 7, 8],
                                              "n": 3, "stream": True, **LONG}, 4),
            _hang_up(http, "/v1/chat/completions", {**chat, **LONG}),
            _whole(http, "/v1/completions", {"model": MODEL, "prompt": DOOMED + [i + 20],
                                             "max_tokens": 12}),
            _stream(http, "/v1/completions", {"model": MODEL, "prompt": DOOMED + [i + 30],
                                              "max_tokens": 12, "stream": True}),
            _whole(http, "/v1/completions", {"model": MODEL, "prompt": [9] * 300}),
            _whole(http, "/v1/chat/completions", {"model": MODEL, "messages": "not a list"}),
            _whole(http, "/generate", {"inputs": "", "parameters": {"max_new_tokens": 4}}),
        ]
    return calls


async def _run_burst(url: str, key: str) -> list[str]:
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
        return await asyncio.gather(*_burst(http))


def _series(metrics: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in metrics.splitlines()
            if line and not line.startswith("#")}


def _per_request(series: set[str]) -> list[str]:
    """The series with a label value that looks like a request id, response id or key id
    (but the per-key series: one per key, dropped when the key is revoked)."""
    return [s for s in series if not s.startswith("switchyard_key_")
            and any(PER_REQUEST.fullmatch(v) for v in re.findall(r'="([^"]*)"', s))]


def _wait_idle(backend: NativeBackend, app: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _leftovers(backend, app):
            return
        time.sleep(0.05)
    assert _leftovers(backend, app) == {}


def _leftovers(backend: NativeBackend, app: Any) -> dict[str, int]:
    """Every per-request container, by name, that still holds something."""
    engine = backend.engine
    assert engine is not None
    blocks, scheduler = engine.block_manager, engine.scheduler
    access = app.state.gateway.access
    assert isinstance(access, KeyAccess) and isinstance(access._limiter, MemoryLimiter)
    deployments = [d for _, d in app.state.gateway.models.deployments()]
    sizes = {
        "kv blocks used": blocks.num_used_blocks,
        "block owners": len(blocks._owners),
        "queued block copies": len(blocks._copies),
        "engine groups": len(engine._groups),
        "scheduler waiting": len(scheduler.waiting),
        "scheduler running": len(scheduler.running),
        "scheduler solo": len(scheduler.solo),
        "backend streams": len(backend._streams),
        "backend in flight": backend._in_flight,
        "backend waiting": len(backend._waiting),
        "backend waiting tokens": backend._waiting.total_tokens,
        "drain scopes": app.state.drain.in_flight,
        "deployments in flight": sum(d.in_flight for d in deployments),
        "auth pending settlements": len(access._pending),
        "auth leases": sum(len(s.inflight) for s in access._limiter._keys.values()),
    }
    return {name: size for name, size in sizes.items() if size}


def test_a_mixed_burst_leaves_nothing_behind(served: tuple[str, Any, NativeBackend]) -> None:
    url, app, backend = served
    engine = backend.engine
    assert engine is not None
    key = httpx.post(f"{url}/admin/keys", headers=admin_headers(),
                     json={"name": "burst", "parallel": 1000}).json()
    aborted = engine.num_aborted
    first = asyncio.run(_run_burst(url, key["key"]))
    _wait_idle(backend, app)
    assert set(first) <= {"200", "400", "422", "429", "500", "cut", "hung up"}, first
    assert first.count("cut") >= 3 and "hung up" in first and "500" in first, first
    assert engine.num_aborted > aborted and engine.num_failed_requests >= 3
    metrics = httpx.get(f"{url}/metrics").text
    second = asyncio.run(_run_burst(url, key["key"]))
    _wait_idle(backend, app)
    assert len(second) == len(first)
    blocks = engine.block_manager
    blocks.check_integrity()
    assert blocks.num_free_blocks == blocks.num_blocks
    later = httpx.get(f"{url}/metrics").text
    grown = _series(later) - _series(metrics)
    assert not _per_request(grown), grown
    assert not _per_request(_series(later))
    assert httpx.delete(f"{url}/admin/keys/{key['id']}", headers=admin_headers()).is_success
    revoked = httpx.get(f"{url}/metrics").text
    assert key["id"] in later and key["id"] not in revoked  # per-key series go with the key
