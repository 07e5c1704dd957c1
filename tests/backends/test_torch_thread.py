"""Each backend's torch work runs in one thread, from loading to every step: a second thread
that ran OpenMP regions (the loader's) makes libgomp stop spinning its workers, and every
step then pays futex wake-ups (2x the default model's decode step over HTTP)."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from backends.base import GenerationRequest, SamplingParams
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine
from backends.torch_thread import start_torch_thread
from backends.transformers import backend as transformers_backend
from backends.transformers.backend import TransformersBackend
from backends.transformers.options import TransformersOptions

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
_where = contextvars.ContextVar("where", default="unset")


async def test_load_and_serve_run_in_the_same_new_thread() -> None:
    seen: list[tuple[str, int]] = []
    served = threading.Event()

    def load() -> str:
        seen.append(("load", threading.get_ident()))
        return "model"

    def serve(model: str) -> None:
        seen.append((f"serve {model}", threading.get_ident()))
        served.set()

    thread, loaded = await start_torch_thread("worker", load, serve)
    assert loaded == "model" and thread.name == "worker"
    assert await asyncio.to_thread(served.wait, 10)
    assert seen == [("load", thread.ident), ("serve model", thread.ident)]
    assert thread.ident != threading.get_ident()


async def test_a_failed_load_raises_in_the_caller_and_never_serves() -> None:
    served: list[object] = []

    def load() -> None:
        raise ValueError("no weights in /nowhere")

    with pytest.raises(ValueError, match="no weights in /nowhere"):
        await start_torch_thread("worker", load, served.append)
    assert served == []


async def test_the_load_sees_the_callers_context_variables() -> None:
    _where.set("the caller")
    _, loaded = await start_torch_thread("worker", _where.get, lambda _: None)
    assert loaded == "the caller"


async def test_a_second_live_torch_thread_is_warned_about(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = threading.Event()
    first, _ = await start_torch_thread("first", lambda: None, lambda _: release.wait(10))
    with caplog.at_level("WARNING", logger="backends.torch_thread"):
        second, _ = await start_torch_thread("second", lambda: None, lambda _: None)
    release.set()
    await asyncio.to_thread(first.join, 10)
    await asyncio.to_thread(second.join, 10)
    warnings = [r.getMessage() for r in caplog.records if "'second' starts" in r.getMessage()]
    assert len(warnings) == 1  # (threads of other tests' backends may be named there too)
    assert "'first'" in warnings[0] and "2x" in warnings[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="backends.torch_thread"):
        await start_torch_thread("third", lambda: None, lambda _: None)  # the others ended
    assert not any("'first'" in r.getMessage() or "'second'" in r.getMessage()
                   for r in caplog.records)


def _record_threads(monkeypatch: pytest.MonkeyPatch, owner: Any, names: list[str]) -> set[int]:
    """Wrap `owner.<name>` for each name so that each call records its thread."""
    threads: set[int] = set()
    for name in names:
        original = getattr(owner, name)

        def recorded(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            threads.add(threading.get_ident())
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)
    return threads


async def _serve_one_request(backend: Any) -> list[Any]:
    """Start `backend`, stream one request through it, close it; the request's events."""
    await backend.start()
    try:
        request = GenerationRequest("r1", GREEDY, prompt_token_ids=[5, 6, 7])
        return [event async for event in backend.generate(request)]
    finally:
        await backend.close()


async def test_the_native_engine_loads_and_steps_in_its_engine_thread(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = _record_threads(monkeypatch, LLMEngine, ["__init__", "step"])
    backend = NativeBackend(EngineConfig(
        model=str(tiny_model("llama_gqa")), dtype="float32", max_total_tokens=64,
        max_batch_total_tokens=256, block_size=8, compile=False))
    events = await _serve_one_request(backend)
    assert events[-1].finish_reason == "length"
    assert threads and threads != {threading.get_ident()}
    assert len(threads) == 1  # built and stepped by the same thread


async def test_the_transformers_backend_loads_and_generates_in_one_thread(
    tiny_model: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch,
) -> None:
    threads = _record_threads(monkeypatch, transformers_backend, ["load", "run_job"])
    backend = TransformersBackend(str(tiny_model("llama_gqa")),
                                  TransformersOptions(dtype="float32", max_total_tokens=64))
    events = await _serve_one_request(backend)
    assert events[-1].finish_reason == "length"
    assert len(threads) == 1 and threads != {threading.get_ident()}
