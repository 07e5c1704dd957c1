"""TGIBackend against the TGI stub (TGI's /generate_stream wire format, real HTTP)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from backends.base import (
    Backend,
    DeploymentError,
    GenerationRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
)
from backends.registry import BackendSpec, create_backend
from backends.tgi.payload import build_payload
from tests.backends.harness import Result, collect, request
from tests.backends.tgi_stub import LOGPROB, PIECES, StubTGI, create_stub_app
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
    room = 64 - backend.count_tokens(request("a b c"))  # the window less the prompt
    assert greedy == {"max_new_tokens": 4, "details": True, "decoder_input_details": False,
                      "stop": [], "do_sample": False}
    assert sampled == {
        "max_new_tokens": room, "details": True, "decoder_input_details": False,
        "stop": ["dog"], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "seed": 11, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
    }
    assert unbounded["max_new_tokens"] == room  # the room reserved, not TGI's whole window
    assert stub.headers[0]["x-model"] == "served-upstream"
    assert backend.info().max_total_tokens == 64  # read from /info


def test_a_temperature_too_small_to_sample_is_sent_as_greedy() -> None:
    """TGI refuses temperature <= 0, and the engines treat one below 1e-5 as greedy too."""
    params = build_payload("a b c", SamplingParams(temperature=1e-6, top_k=5, seed=3))
    assert params["parameters"]["do_sample"] is False
    assert not {"temperature", "top_k", "seed"} & set(params["parameters"])


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


async def test_top_logprobs_are_tgis_top_n_tokens_best_first(upstream, stub) -> None:
    backend = await started(upstream[0])
    got = await collect(backend, request("a b c", max_tokens=3, logprobs=True, top_logprobs=3))
    await backend.close()
    assert stub.requests[0]["parameters"]["top_n_tokens"] == 3
    for event, piece in zip(got.events, PIECES, strict=False):
        (token,) = event.tokens
        assert [a.text for a in token.top_logprobs] == [piece, "alt1", "alt2"]
        assert [a.logprob for a in token.top_logprobs] == [LOGPROB, LOGPROB - 1, LOGPROB - 2]
        assert token.top_logprobs[1].id == 901


async def test_prompt_logprobs_come_from_generate_with_decoder_input_details(
    upstream, stub,
) -> None:
    backend = await started(upstream[0])
    req = GenerationRequest(request_id="prefill", prompt="a b c", sampling=SamplingParams(
        max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=2, prompt_logprobs=0,
        stop=(" brown",)))
    got = await collect(backend, req)
    streamed = await collect(backend, request("a b c", max_tokens=4, logprobs=True,
                                              top_logprobs=2, stop=(" brown",)))
    await backend.close()
    sent = stub.requests[0]["parameters"]
    assert sent["decoder_input_details"] is True and sent["top_n_tokens"] == 2
    prompt = got.events[0].prompt_tokens
    assert [(t.id, t.text, t.logprob) for t in prompt] == [
        (0, "a", None), (1, "b", -1.5), (2, "c", -1.5)]
    assert all(e.prompt_tokens is None for e in got.events[1:])
    # the rest equals the streamed answer: text cut at the stop, tokens, finish, usage
    assert got.text == streamed.text == " The quick"
    assert [e.tokens for e in got.events] == [e.tokens for e in streamed.events]
    assert (got.last.finish_reason, got.last.stop_reason, got.usage) == (
        streamed.last.finish_reason, streamed.last.stop_reason, streamed.usage)


async def test_structured_outputs_become_tgis_grammar(upstream, stub) -> None:
    backend = await started(upstream[0])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for spec in (StructuredOutput("json_object"),
                 StructuredOutput("json_schema", json.dumps(schema)),
                 StructuredOutput("regex", "[0-9]+")):
        await collect(backend, request("a b c", max_tokens=2, structured=spec))
    with pytest.raises(RequestError) as lark:
        await anext(backend.generate(request("a b c", structured=StructuredOutput(
            "lark", "start: \"x\""))))
    await backend.close()
    grammars = [r["parameters"]["grammar"] for r in stub.requests]
    assert grammars == [{"type": "json", "value": {"type": "object"}},
                        {"type": "json", "value": schema},
                        {"type": "regex", "value": "[0-9]+"}]
    assert lark.value.param == "response_format" and "TGI" in lark.value.message


@pytest.mark.parametrize(("sampling", "param"), [
    ({"n": 2}, "n"), ({"logit_bias": ((5, 1.0),)}, "logit_bias"),
    ({"min_tokens": 2}, "min_tokens"), ({"min_p": 0.1}, "min_p"),
])
async def test_what_tgi_has_no_parameter_for_is_refused(upstream, stub, sampling, param) -> None:
    backend = await started(upstream[0])
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(request("hi", **sampling)))
    await backend.close()
    assert caught.value.status_code == 400 and caught.value.param == param
    assert "TGI backend" in caught.value.message and not stub.requests


TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


async def test_tools_reach_the_chat_template(upstream, stub, tokenizer_dir: Path,
                                             tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tokenizer_dir, folder)
    (folder / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    tools = [{"type": "function", "function": {"name": "weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]
    backend = await started(upstream[0], tokenizer=str(folder))
    req = GenerationRequest(request_id="tools", messages=MESSAGES, tools=tools,
                            sampling=SamplingParams(max_tokens=2, temperature=0.0))
    await collect(backend, req)
    await backend.close()
    hf = AutoTokenizer.from_pretrained(folder)
    want = hf.apply_chat_template(MESSAGES, tools=tools, add_generation_prompt=True,
                                  tokenize=False)
    assert "weather" in want and stub.requests[0]["inputs"] == want
    assert backend.info().chat_template == TOOLS_TEMPLATE


async def test_detokenize_with_the_tokenizer_option(upstream, tokenizer_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = hf("The quick brown fox").input_ids
    backend = await started(upstream[0], tokenizer=str(tokenizer_dir))
    assert backend.detokenize(ids) == hf.decode(ids)
    with pytest.raises(RequestError):
        backend.detokenize([-1])
    await backend.close()
