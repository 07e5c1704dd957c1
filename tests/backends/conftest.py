"""The backends under the contract suite, one entry each in CASES.

Every case is a started Backend on the shared LoopRunner plus what the suite needs to judge
it: a reference (what the answer must equal), whether token ids are exact, how to see the
upstream free a closed request. Backends that front a Switchyard upstream must equal the
native engine's own output on the same tiny model.

Adding a backend: one `CASES["name"] = factory` entry; a factory gets an `Env` and returns a
`Case` (see `_native_case`).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from backends.base import Backend, GenerationRequest, Usage
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.registry import BackendSpec, create_backend
from gateway.app import create_app
from gateway.settings import Settings
from tests.backends.harness import LoopRunner, Result, collect
from tests.backends.recording import Recording
from tests.backends.tgi_stub import EOS, MAX_TOTAL_TOKENS, StubTGI, create_stub_app, script
from tests.gateway.conftest import running_server

MODEL = "tiny"
T = TypeVar("T")
MAX_TOTAL = 256


@dataclass
class Case:
    backend: Backend
    kind: str  # info().backend
    max_total_tokens: int
    reference: Callable[[GenerationRequest], Result]
    idle: Callable[[], bool]  # the backend and its upstream hold nothing for any request
    closed_upstream: Callable[[], int] | None = None  # generations the upstream saw closed
    exact_token_ids: bool = True
    exact_counts: bool = True  # count_tokens equals the reference's prompt tokens
    knows_stop_reason: bool = True  # OpenAI's API does not say which stop ended an answer
    runner: LoopRunner | None = None  # set by the `case` fixture

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        assert self.runner is not None
        return self.runner.run(coro)

    def collect(self, req: GenerationRequest) -> Result:
        return self.run(collect(self.backend, req))


class Env:
    """Lazy access to the shared pieces (the Switchyard upstream, the stub, the tokenizer)."""

    def __init__(self, request: pytest.FixtureRequest, runner: LoopRunner) -> None:
        self._request = request
        self.runner = runner

    def get(self, fixture: str):  # noqa: ANN201 - whatever the fixture is
        return self._request.getfixturevalue(fixture)

    def native_reference(self, req: GenerationRequest) -> Result:
        return self.runner.run(collect(self.get("native_direct"), req))

    def create(self, backend: str, options: dict) -> Backend:
        spec = BackendSpec(name=MODEL, model_id="unused", backend=backend, options=options)
        return create_backend(spec)


def engine_config(model: Path) -> EngineConfig:
    return EngineConfig(
        model=str(model), served_model_name=MODEL, dtype="float32", max_total_tokens=MAX_TOTAL,
        max_batch_total_tokens=2048, block_size=8, compile=False,
    )


def native_idle(backend: Backend) -> bool:
    stats = backend.stats()
    return stats.running == 0 and stats.queue_size == 0 and stats.kv_blocks_used == 0


def _native_case(env: Env) -> Case:
    backend = env.get("native_direct")
    return Case(backend, "native", MAX_TOTAL, env.native_reference, lambda: native_idle(backend))


def _over_switchyard(env: Env, kind: str, options: dict, exact: bool) -> Case:
    url, upstream = env.get("switchyard_upstream")
    backend = env.create(kind, {"base_url": url + ("/v1" if kind == "remote" else ""),
                                "tokenizer": str(env.get("tokenizer_dir")), **options})
    env.runner.run(backend.start())

    def idle() -> bool:
        return backend.stats().running == 0 and native_idle(upstream)

    return Case(backend, kind, MAX_TOTAL, env.native_reference, idle,
                lambda: upstream.closed_early, exact_token_ids=exact, knows_stop_reason=exact)


def _stub_reference(backend: Backend) -> Callable[[GenerationRequest], Result]:
    """What the contract makes of the stub's script: stop text cut, special text dropped."""
    from backends.base import GenerationEvent, TokenInfo

    def reference(req: GenerationRequest) -> Result:
        words = len(backend.counter.prompt_text(req).split())  # type: ignore[attr-defined]
        wanted = req.sampling.max_tokens or MAX_TOTAL_TOKENS - words
        tokens, reason = script(wanted, list(req.sampling.stop))
        text = "".join(t["text"] for t in tokens if t is not EOS)
        cuts = [text.find(s) for s in req.sampling.stop if s in text]
        text = text[:min(cuts)] if cuts else text
        infos = tuple(TokenInfo(t["id"], t["text"], None, t["special"]) for t in tokens)
        return Result([GenerationEvent(text=text, tokens=infos,
                                       finish_reason="length" if reason == "length" else "stop",
                                       usage=Usage(words, len(tokens)))])

    return reference


def _stub_case(env: Env) -> Case:
    url, stub = env.get("tgi_stub")
    backend = env.create("tgi", {"base_url": url, "tokenizer": str(env.get("tokenizer_dir"))})
    env.runner.run(backend.start())
    return Case(backend, "tgi", MAX_TOTAL_TOKENS, _stub_reference(backend),
                lambda: stub.active == 0 and backend.stats().running == 0,
                lambda: stub.cancelled, exact_counts=False)


def _transformers_case(env: Env) -> Case:
    """Hugging Face `generate` on the same tiny float32 model: the native engine's exact ids."""
    path = env.get("tiny_model")("llama_gqa")
    backend = create_backend(BackendSpec(
        name=MODEL, model_id=str(path), backend="transformers",
        options={"dtype": "float32", "max_total_tokens": MAX_TOTAL},
    ))
    env.runner.run(backend.start())

    def idle() -> bool:
        return backend.stats().running == 0 and backend.stats().queue_size == 0

    return Case(backend, "transformers", MAX_TOTAL, env.native_reference, idle)


CASES: dict[str, Callable[[Env], Case]] = {
    "native": _native_case,
    "transformers": _transformers_case,
    "remote": lambda env: _over_switchyard(env, "remote", {"max_total_tokens": MAX_TOTAL}, False),
    "tgi": lambda env: _over_switchyard(env, "tgi", {}, True),
    "tgi_stub": _stub_case,
}


@pytest.fixture(scope="session")
def runner() -> Iterator[LoopRunner]:
    loop_runner = LoopRunner()
    yield loop_runner
    loop_runner.close()


@pytest.fixture(scope="session")
def native_direct(runner: LoopRunner, tiny_model: Callable[[str], Path]) -> Iterator[Backend]:
    backend = NativeBackend(engine_config(tiny_model("llama_gqa")))
    runner.run(backend.start())
    yield backend
    runner.run(backend.close())


@pytest.fixture(scope="session")
def switchyard_upstream(
    tiny_model: Callable[[str], Path],
) -> Iterator[tuple[str, Recording]]:
    """A second Switchyard: the native engine on the same tiny model, behind real HTTP."""
    upstream = Recording(NativeBackend(engine_config(tiny_model("llama_gqa"))))
    app = create_app(Settings(model_id="unused"), backends={MODEL: upstream})
    with running_server(app, timeout_s=180) as url:
        yield url, upstream


@pytest.fixture(scope="session")
def tgi_stub() -> Iterator[tuple[str, StubTGI]]:
    stub = StubTGI(delay_s=0.02)
    with running_server(create_stub_app(stub)) as url:
        yield url, stub


@pytest.fixture(scope="session", params=list(CASES))
def case(request: pytest.FixtureRequest, runner: LoopRunner) -> Iterator[Case]:
    made = CASES[request.param](Env(request, runner))
    made.runner = runner
    yield made
    if request.param != "native":  # native_direct is shared; it closes itself
        runner.run(made.backend.close())
