"""OpenAI depth over a real server and the openai SDK: n choices, logprobs shapes, the new
sampling fields, best_of, and metering of several choices (echo and scripted backends)."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from auth.limits import Consumed
from backends.base import GenerationEvent, GenerationRequest, SamplingParams, TokenInfo, Usage
from gateway.app import create_app
from gateway.guard import PromptTokens, _Meter
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.echo_backend import WORDS, EchoBackend
from tests.gateway.scripted_backend import ScriptedBackend

MESSAGES = [{"role": "user", "content": "say words"}]


def _echo_text(k: int, words: int) -> str:
    """Echo's choice k: WORDS from k on, `words` of them."""
    return " ".join(WORDS[(i + k) % len(WORDS)] for i in range(words))


def _stream_by_choice(chunks: list) -> tuple[dict[int, str], dict[int, list[str]]]:
    text: dict[int, str] = defaultdict(str)
    finishes: dict[int, list[str]] = defaultdict(list)
    for chunk in chunks:
        assert len(chunk.choices) <= 1  # one choice per chunk, named by its index
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
    return dict(text), dict(finishes)


def test_chat_n_whole(client: openai.OpenAI, echo_backends: dict[str, EchoBackend]) -> None:
    out = client.chat.completions.create(model="echo", messages=MESSAGES, n=3)
    assert echo_backends["echo"].requests[-1].sampling.n == 3
    assert [c.index for c in out.choices] == [0, 1, 2]
    # Echo's choice k stops after 8 - k words.
    assert [c.message.content for c in out.choices] == [_echo_text(k, 8 - k) for k in range(3)]
    assert all(c.finish_reason == "stop" for c in out.choices)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2, 8 + 7 + 6)


def test_chat_n_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="echo", messages=MESSAGES, n=3, max_tokens=7)
    chunks = list(client.chat.completions.create(
        model="echo", messages=MESSAGES, n=3, max_tokens=7, stream=True,
        stream_options={"include_usage": True}))
    *content, last = chunks
    openings = [c.choices[0].index for c in content if c.choices[0].delta.role == "assistant"]
    assert sorted(openings) == [0, 1, 2]
    text, finishes = _stream_by_choice(content)
    assert text == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    assert [c.finish_reason for c in whole.choices] == ["length", "length", "stop"]
    # Choices finish at different times: a finish chunk precedes other choices' deltas.
    first_finish = next(i for i, c in enumerate(content) if c.choices[0].finish_reason)
    assert any(c.choices[0].delta.content for c in content[first_finish + 1:])
    assert last.choices == [] and last.usage.completion_tokens == 7 + 7 + 6
    assert last.usage.completion_tokens == whole.usage.completion_tokens


def test_completions_n_stream_equals_whole(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="echo", prompt="a b", n=2, max_tokens=4,
                                      logprobs=2)
    chunks = list(client.completions.create(model="echo", prompt="a b", n=2, max_tokens=4,
                                            logprobs=2, stream=True))
    assert [c.text for c in whole.choices] == [_echo_text(0, 4), _echo_text(1, 4)]
    for choice in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        streamed = [c.logprobs for c in mine if c.logprobs is not None]
        assert sum((lp.tokens for lp in streamed), []) == choice.logprobs.tokens
        assert sum((lp.text_offset for lp in streamed), []) == choice.logprobs.text_offset
        assert sum((lp.top_logprobs for lp in streamed), []) == choice.logprobs.top_logprobs
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert whole.usage.completion_tokens == 8


def test_chat_logprobs_shape(http: httpx.Client) -> None:
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 3, "logprobs": True,
            "top_logprobs": 2}
    whole = http.post("/v1/chat/completions", json=body).json()
    logprobs = whole["choices"][0]["logprobs"]
    assert set(logprobs) == {"content", "refusal"}
    first = logprobs["content"][0]
    assert first == {
        "token": "alpha", "logprob": -0.5, "bytes": list(b"alpha"),
        "top_logprobs": [
            {"token": "alpha", "logprob": -0.5, "bytes": list(b"alpha")},
            {"token": "beta", "logprob": -1.5, "bytes": list(b"beta")},
        ],
    }
    assert [t["token"] for t in logprobs["content"]] == ["alpha", " beta", " gamma"]
    # top_logprobs: 0 with logprobs: the chosen token's logprob, no alternatives.
    plain = http.post("/v1/chat/completions", json={**body, "top_logprobs": 0}).json()
    assert all(t["top_logprobs"] == [] for t in plain["choices"][0]["logprobs"]["content"])


def test_chat_streamed_logprobs_equal_whole(client: openai.OpenAI) -> None:
    kwargs = {"model": "echo", "messages": MESSAGES, "max_tokens": 5, "n": 2,
              "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    for choice in whole.choices:
        streamed = [t for c in chunks if c.choices and c.choices[0].index == choice.index
                    and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
        assert streamed == choice.logprobs.content
        assert all(t.top_logprobs[0].token == t.token for t in streamed)
        assert all(len(t.top_logprobs) == 3 for t in streamed)


def test_completion_logprobs_shape(http: httpx.Client) -> None:
    body = {"model": "echo", "prompt": "x", "max_tokens": 2, "logprobs": 2}
    logprobs = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert logprobs == {
        "tokens": ["alpha", " beta"], "token_logprobs": [-0.5, -0.5],
        "top_logprobs": [{"alpha": -0.5, "beta": -1.5}, {" beta": -0.5, " gamma": -1.5}],
        "text_offset": [0, 5],
    }
    zero = http.post("/v1/completions", json={**body, "logprobs": 0}).json()
    assert zero["choices"][0]["logprobs"]["top_logprobs"] is None
    assert zero["choices"][0]["logprobs"]["token_logprobs"] == [-0.5, -0.5]


def test_new_sampling_fields_reach_the_backend(
    http: httpx.Client, echo_backends: dict[str, EchoBackend],
) -> None:
    body = {"model": "echo", "messages": MESSAGES, "max_tokens": 4, "n": 2,
            "logit_bias": {"3": -100, "7": 2.5}, "min_tokens": 2, "min_p": 0.1, "top_k": 5,
            "stop_token_ids": [9], "repetition_penalty": 1.2, "logprobs": True,
            "top_logprobs": 4, "frequency_penalty": 0.5,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "strict": True,
                "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}}
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    sampling = echo_backends["echo"].requests[-1].sampling
    assert sampling.logit_bias == ((3, -100.0), (7, 2.5))
    assert (sampling.n, sampling.min_tokens, sampling.min_p, sampling.top_k) == (2, 2, 0.1, 5)
    assert (sampling.stop_token_ids, sampling.repetition_penalty) == ((9,), 1.2)
    assert (sampling.logprobs, sampling.top_logprobs, sampling.frequency_penalty) == (
        True, 4, 0.5)
    assert sampling.structured is not None and sampling.structured.kind == "json_schema"
    assert json.loads(sampling.structured.spec) == body["response_format"]["json_schema"][
        "schema"]
    structured = sampling.structured
    assert (structured.source, structured.name, structured.strict) == (
        "response_format", "answer", True)


@pytest.mark.parametrize(("extra", "kind", "spec", "source"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "", "response_format"),
    ({"response_format": {"type": "text"}}, None, None, None),
    ({"guided_regex": "[0-9]+"}, "regex", "[0-9]+", "guided_regex"),
    ({"guided_choice": ["yes", "no."]}, "regex", "(yes|no\\.)", "guided_choice"),
    ({"guided_json": {"type": "array"}}, "json_schema", '{"type": "array"}', "guided_json"),
    ({"structured_outputs": {"grammar": "start: \"a\""}}, "lark", "start: \"a\"",
     "structured_outputs"),
])
def test_structured_output_mapping(
    http: httpx.Client, echo_backends: dict[str, EchoBackend], extra: dict, kind: str | None,
    spec: str | None, source: str | None,
) -> None:
    response = http.post("/v1/completions", json={"model": "echo", "prompt": "x", **extra})
    assert response.status_code == 200, response.text
    structured = echo_backends["echo"].requests[-1].sampling.structured
    if kind is None:
        assert structured is None
    else:  # the source is the parameter a compile error names
        assert (structured.kind, structured.spec, structured.source) == (kind, spec, source)


def _scripted_url(serve_app: ServeApp, backend: ScriptedBackend) -> str:
    return serve_app(create_app(Settings(), backends={"scripted": backend}))


def test_best_of_returns_the_likeliest(serve_app: ServeApp) -> None:
    # Choice k's tokens have logprob -(k + 1) / 10, except choice 2 is the likeliest.
    backend = ScriptedBackend(["one", " two", " three"],
                              logprob_of=lambda k: -0.01 if k == 2 else -0.1 * (k + 1))
    client = openai.OpenAI(base_url=f"{_scripted_url(serve_app, backend)}/v1", api_key="k",
                           max_retries=0)
    out = client.completions.create(model="scripted", prompt="p", best_of=4, n=2)
    sampling = backend.requests[-1].sampling
    assert (sampling.n, sampling.logprobs) == (4, True)  # ranked by logprobs, asked or not
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.logprobs is None for c in out.choices)
    assert out.usage.completion_tokens == 4 * 3  # every candidate was generated
    ranked = client.completions.create(model="scripted", prompt="p", best_of=4, n=2,
                                       logprobs=0)
    assert [c.logprobs.token_logprobs[0] for c in ranked.choices] == [-0.01, -0.1]


def test_n_is_metered_and_traced_once(http: httpx.Client) -> None:
    def generated() -> tuple[float, float]:
        text = http.get("/metrics").text
        values = {s.name: s.value for f in text_string_to_metric_families(text)
                  for s in f.samples if s.labels.get("model") == "echo"}
        return (values["tgi_request_generated_tokens_count"],
                values["tgi_request_generated_tokens_sum"])

    count, total = generated()
    out = http.post("/v1/chat/completions",
                    json={"model": "echo", "messages": MESSAGES, "n": 3}).json()
    assert out["usage"]["completion_tokens"] == 21
    assert generated() == (count + 1, total + 21)


class _Admission:
    headers: dict[str, str] = {}

    def __init__(self) -> None:
        self.settled: list[Consumed] = []

    async def settle(self, used: Consumed) -> None:
        self.settled.append(used)


def test_meter_sums_choices_and_bills_a_cut_stream() -> None:
    request = GenerationRequest("r", SamplingParams(n=2, max_tokens=10), prompt="a b c")
    echo = EchoBackend()
    token = TokenInfo(id=0, text="x")
    events = [GenerationEvent("x", (token,), index=0), GenerationEvent("x", (token,), index=1),
              GenerationEvent("x", (token,), index=1, finish_reason="stop", usage=Usage(3, 2))]

    async def run(upto: int) -> Consumed:
        admission = _Admission()
        meter = _Meter(admission, PromptTokens(echo, request))  # type: ignore[arg-type]
        for event in events[:upto]:
            meter.observe(event)
        await meter.settle()
        await meter.settle()  # settled once
        assert len(admission.settled) == 1
        return admission.settled[0]

    assert asyncio.run(run(3)) == Consumed(3, 1 + 2, True)  # choice 0 cut short after 1
    assert asyncio.run(run(2)) == Consumed(3, 2, True)  # prompt recounted: 3 words
    reserve = asyncio.run(PromptTokens(echo, request).reserve())
    assert reserve == 3 + 2 * 10  # n choices of max_tokens each
