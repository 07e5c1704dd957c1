"""The tgi_* request metrics, their outcomes and the scrape-time backend metrics (no engine)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.base import (
    BackendStats,
    GenerationEvent,
    GenerationRequest,
    RequestError,
    RequestTimings,
    StepTiming,
)
from gateway.app import create_app
from gateway.metrics import ExactCounter, failure_kind
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.echo_backend import EchoBackend, prompt_text

MESSAGES = [{"role": "user", "content": "a b c"}]
Events = AsyncIterator[GenerationEvent]


@dataclass
class EngineLikeBackend(EchoBackend):
    """An echo backend reporting what an engine does: timings, step timings, cache stats."""

    steps: list[StepTiming] = field(default_factory=list)

    def stats(self) -> BackendStats:
        return BackendStats(queue_size=2, running=3, kv_blocks_used=4, kv_blocks_total=16,
                            batch_max_tokens=300, batch_next_size=1, prefix_cache_queries=10,
                            prefix_cache_hits=7, preemptions=2, expert_tokens=(5, 0, 9))

    def drain_step_timings(self) -> list[StepTiming]:
        drained, self.steps = self.steps, []
        return drained

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        if "BUSY" in prompt_text(req):
            return self._overloaded()
        return self._timed(super().generate(req))

    async def _overloaded(self) -> AsyncIterator[GenerationEvent]:
        raise RequestError("too many requests in flight", code="overloaded", status_code=429,
                           error_type="overloaded")
        yield GenerationEvent()  # pragma: no cover (makes this an async generator)

    async def _timed(self, events: Events) -> Events:
        async for event in events:
            if event.finish_reason is not None:
                self.steps += [StepTiming("prefill", 0.002, 1), StepTiming("decode", 0.001, 1)]
                event = GenerationEvent(
                    text=event.text, tokens=event.tokens, finish_reason=event.finish_reason,
                    usage=event.usage, timings=RequestTimings(0.01, 0.04))
            yield event


@pytest.fixture(scope="module")
def engine_like() -> EngineLikeBackend:
    return EngineLikeBackend(name="engine", max_total_tokens=1000, delay_s=0.001)


@pytest.fixture(scope="module")
def url(serve_app_module: ServeApp, engine_like: EngineLikeBackend) -> str:
    return serve_app_module(create_app(Settings(), backends={"engine": engine_like}))


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=10) as session:
        yield session


def sample(text: str, name: str, **labels: str) -> float:
    """A sample's value, parsed by prometheus_client's parser (0 when absent).

    The parser reports every counter sample as `<name>_total`, TGI's exact ones included.
    """
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (name, f"{name}_total") and s.labels == labels:
                return s.value
    return 0.0


def settled(http: httpx.Client, check: Callable[[str], bool]) -> str:
    """Request outcomes are recorded when the exchange ends: poll briefly for them."""
    deadline = time.monotonic() + 5
    while True:
        text = http.get("/metrics").text
        if check(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.01)


def test_outcomes_by_kind(http: httpx.Client) -> None:
    chat = {"model": "engine", "messages": MESSAGES, "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert http.post("/v1/chat/completions", json={**chat, "max_tokens": 0}).status_code == 400
    assert http.post("/v1/chat/completions", json={**chat, "model": "ghost"}).status_code == 404
    broken = {**chat, "messages": [{"role": "user", "content": "FAIL_MIDWAY"}], "stream": True}
    assert '"error"' in http.post("/v1/chat/completions", json=broken).text
    assert http.post("/generate", json={"inputs": "a b", "parameters": {"top_k": 0}}) \
        .status_code == 422
    text = settled(http, lambda t: sample(t, "tgi_request_count", model="engine") >= 3)
    assert sample(text, "tgi_request_count", model="engine") == 3
    # Refused before a model was chosen: a bad body, an unknown model.
    assert sample(text, "tgi_request_count", model="") == 2
    assert sample(text, "tgi_request_success", model="engine") == 1
    assert sample(text, "tgi_request_failure", err="validation", model="engine") == 1
    assert sample(text, "tgi_request_failure", err="validation", model="") == 1
    assert sample(text, "tgi_request_failure", err="not_found", model="") == 1
    assert sample(text, "tgi_request_failure", err="generation", model="engine") == 1
    assert sample(text, "tgi_request_duration_count", model="engine") == 1
    assert sample(text, "tgi_request_generated_tokens_sum", model="engine") == 4
    assert sample(text, "tgi_request_input_length_sum", model="engine") == 3
    assert sample(text, "tgi_request_queue_duration_sum", model="engine") == pytest.approx(0.01)
    assert sample(text, "tgi_request_inference_duration_sum", model="engine") \
        == pytest.approx(0.04)
    assert sample(text, "tgi_request_mean_time_per_token_duration_sum", model="engine") \
        == pytest.approx(0.01)
    assert sample(text, "switchyard_time_to_first_token_seconds_count", model="engine") >= 2
    assert sample(text, "switchyard_inter_token_latency_seconds_count", model="engine") >= 3


def test_overloaded_backend_answers_429_with_retry_after(http: httpx.Client) -> None:
    busy = {"model": "engine", "messages": [{"role": "user", "content": "BUSY"}]}
    for body in (busy, {**busy, "stream": True}):
        answer = http.post("/v1/chat/completions", json=body)
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert error["type"] == "overloaded" and error["code"] == "overloaded"
    for route in ("/generate", "/generate_stream"):
        answer = http.post(route, json={"inputs": "BUSY"})
        assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
        assert answer.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
    text = settled(http, lambda t: sample(t, "tgi_request_failure", err="overloaded",
                                          model="engine") >= 4)
    assert sample(text, "tgi_request_failure", err="overloaded", model="engine") == 4


def test_stream_cut_short_by_the_client_is_aborted(url: str, http: httpx.Client) -> None:
    before = sample(http.get("/metrics").text, "tgi_request_failure", err="aborted",
                    model="engine")
    body = {"inputs": "a b", "parameters": {"max_new_tokens": 900}}
    with httpx.stream("POST", f"{url}/generate_stream", json=body, timeout=10) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data:")
    text = settled(http, lambda t: sample(t, "tgi_request_failure", err="aborted",
                                          model="engine") > before)
    assert sample(text, "tgi_request_failure", err="aborted", model="engine") == before + 1


def test_backend_metrics_read_at_scrape_time(http: httpx.Client, engine_like) -> None:
    engine_like.steps += [StepTiming("decode", 0.003, 2)] * 3
    text = http.get("/metrics").text
    expected = {
        "tgi_queue_size": 2, "tgi_batch_current_size": 3, "tgi_batch_current_max_tokens": 300,
        "tgi_batch_next_size": 1, "switchyard_kv_blocks_used": 4,
        "switchyard_kv_blocks_total": 16, "switchyard_prefix_cache_queries_total": 10,
        "switchyard_prefix_cache_hits_total": 7, "switchyard_preemptions_total": 2,
    }
    for name, value in expected.items():
        assert sample(text, name, model="engine") == value, name
    experts = [sample(text, "switchyard_moe_expert_tokens_total", model="engine", expert=str(e))
               for e in range(3)]
    assert experts == [5, 0, 9]
    assert sample(text, "tgi_batch_forward_duration_count", model="engine", method="decode") >= 3
    again = http.get("/metrics").text  # drained: the same steps are not observed twice
    assert sample(again, "tgi_batch_forward_duration_count", model="engine", method="decode") \
        == sample(text, "tgi_batch_forward_duration_count", model="engine", method="decode")


def test_a_backend_without_step_timings_or_with_broken_stats(serve_app: ServeApp) -> None:
    class Broken(EchoBackend):
        def stats(self) -> BackendStats:
            raise RuntimeError("no stats today")

    url = serve_app(create_app(Settings(), backends={"plain": EchoBackend(), "broken": Broken()}))
    text = httpx.get(f"{url}/metrics").text
    assert sample(text, "tgi_queue_size", model="plain") == 0
    assert 'tgi_queue_size{model="broken"}' not in text
    assert "switchyard_moe_expert_tokens" not in text  # no MoE model, no family


def test_exact_counter_renders_tgi_names() -> None:
    counter = ExactCounter("tgi_request_failure", "Failures", ("err", "model"))
    counter.inc("validation", 'we"ird\\name')
    counter.inc("validation", 'we"ird\\name')
    text = counter.expose()
    assert "# TYPE tgi_request_failure counter\n" in text
    assert 'tgi_request_failure{err="validation",model="we\\"ird\\\\name"} 2.0\n' in text
    assert sample(text, "tgi_request_failure", err="validation", model='we"ird\\name') == 2


@pytest.mark.parametrize(("status", "error_type", "kind"), [
    (400, "invalid_request_error", "validation"), (422, None, "validation"),
    (429, "overloaded", "overloaded"), (429, "rate_limit_error", "rate_limited"),
    (401, None, "unauthorized"), (404, None, "not_found"), (499, None, "aborted"),
    (200, None, "aborted"), (503, None, "unavailable"), (500, "api_error", "generation"),
])
def test_failure_kinds(status: int, error_type: str | None, kind: str) -> None:
    assert failure_kind(status, error_type) == kind
