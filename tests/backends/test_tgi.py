"""TGIBackend against the TGI stub (TGI's /generate_stream wire format, real HTTP)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import Backend, DeploymentError, RequestError
from backends.registry import BackendSpec, create_backend
from tests.backends.harness import Result, collect, request
from tests.backends.tgi_stub import PIECES, StubTGI, create_stub_app
from tests.gateway.conftest import running_server

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[str, StubTGI]]:
    stub = StubTGI()
    with running_server(create_stub_app(stub)) as url:
        yield url, stub


@pytest.fixture
def stub(upstream: tuple[str, StubTGI]) -> StubTGI:
    upstream[1].mode, upstream[1].delay_s = "ok", 0.0
    upstream[1].requests.clear()
    upstream[1].headers.clear()
    return upstream[1]


async def started(base_url: str, **options: Any) -> Backend:
    spec = BackendSpec(name="m", model_id="unused", backend="tgi",
                       options={"base_url": base_url, **options})
    backend = create_backend(spec)
    await backend.start()
    return backend


async def test_parameters_map_to_tgis_names(upstream, stub) -> None:
    backend = await started(upstream[0], model="served-upstream")
    await collect(backend, request("a b c", max_tokens=4))
    await collect(backend, request("a b c", temperature=0.7, top_p=0.9, top_k=5, seed=11,
                                   repetition_penalty=1.1, frequency_penalty=0.5,
                                   stop=("dog",)))
    await collect(backend, request("a b c", max_tokens=None))
    await backend.close()
    greedy, sampled, unbounded = (r["parameters"] for r in stub.requests)
    assert greedy == {"max_new_tokens": 4, "details": True, "decoder_input_details": False,
                      "stop": [], "do_sample": False}
    assert sampled == {
        "max_new_tokens": None, "details": True, "decoder_input_details": False,
        "stop": ["dog"], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "seed": 11, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
    }
    assert unbounded["max_new_tokens"] is None  # TGI: the rest of the window
    assert stub.headers[0]["x-model"] == "served-upstream"
    assert backend.info().max_total_tokens == 64  # read from /info


async def test_usage_and_finish_come_from_tgis_details(upstream, stub) -> None:
    backend = await started(upstream[0])
    eos = await collect(backend, request("a b c", max_tokens=40, logprobs=True))
    stopped = await collect(backend, request("a b c", max_tokens=40, stop=(" fox",)))
    await backend.close()
    assert eos.text == "".join(PIECES) and eos.last.stop_reason == "eos_token"
    assert eos.usage.prompt_tokens == 3 and eos.usage.completion_tokens == len(PIECES) + 1
    assert eos.last.tokens[0].special and eos.last.tokens[0].text == "</s>"
    assert eos.events[0].tokens[0].logprob == -0.25
    assert stopped.text == " The quick brown" and stopped.last.stop_reason == "stop_sequence"
    assert stopped.usage.completion_tokens == 4


async def test_chat_without_a_tokenizer_is_refused_naming_the_option(upstream, stub) -> None:
    backend = await started(upstream[0])
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(request(messages=MESSAGES)))
    await backend.close()
    assert caught.value.status_code == 400 and "`tokenizer`" in caught.value.message
    assert caught.value.param == "messages" and not stub.requests


async def test_chat_is_rendered_with_the_tokenizers_template(
    upstream, stub, tokenizer_dir: Path,
) -> None:
    from transformers import AutoTokenizer

    backend = await started(upstream[0], tokenizer=str(tokenizer_dir))
    await collect(backend, request(messages=MESSAGES, max_tokens=3))
    await backend.close()
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    want = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert stub.requests[0]["inputs"] == want


async def test_unsupported_sampling_is_refused(upstream, stub) -> None:
    backend = await started(upstream[0])
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(request("hi", presence_penalty=0.5)))
    await backend.close()
    assert caught.value.param == "presence_penalty"


async def test_a_tgi_validation_error_passes_through(upstream, stub) -> None:
    stub.mode = "status:422"
    backend = await started(upstream[0])
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(request("hi")))
    await backend.close()
    assert caught.value.status_code == 422 and caught.value.message == "stub says 422"
    assert caught.value.error_type == "validation"


@pytest.mark.parametrize(("mode", "status", "code"), [
    ("status:500", 502, "upstream_error"), ("status:424", 502, "upstream_error"),
    ("status:429", 429, "upstream_rate_limited"), ("hang", 504, "upstream_timeout"),
])
async def test_upstream_failures_raise_before_any_event(upstream, stub, mode, status, code) -> None:
    stub.mode = mode
    backend = await started(upstream[0], read_timeout=0.5)
    with pytest.raises(DeploymentError) as caught:
        await anext(backend.generate(request("hi")))
    await backend.close()
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert caught.value.retry_after == (7.0 if status == 429 else None)


@pytest.mark.parametrize(("mode", "code", "before"), [
    ("malformed", "upstream_malformed", 1), ("die", "upstream_error", 2),
    ("error_event", "upstream_error", 2),
])
async def test_failures_mid_stream_come_after_the_events(
    upstream, stub, mode, code, before,
) -> None:
    stub.mode = mode
    backend = await started(upstream[0])
    got = Result()
    with pytest.raises(DeploymentError) as caught:
        async for event in backend.generate(request("hi", max_tokens=10)):
            got.events.append(event)
    await backend.close()
    assert caught.value.code == code and caught.value.status_code == 502
    assert got.text == "".join(PIECES[:before])
    assert all(e.finish_reason is None for e in got.events)
