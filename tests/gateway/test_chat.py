"""/v1/chat/completions through the openai SDK: shapes, streaming, usage, routing."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.gateway.echo_backend import WORDS, EchoBackend

MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say words"}]


def test_non_stream_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=3)
    assert out.id.startswith("chatcmpl-")
    assert out.object == "chat.completion"
    assert out.model == "echo"
    assert isinstance(out.created, int)
    choice = out.choices[0]
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == "alpha beta gamma"
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        4, 3, 7)


def test_natural_stop(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="echo", messages=MESSAGES)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == " ".join(WORDS[:8])


def test_raw_json_keys_are_exact(http: httpx.Client) -> None:
    body = http.post("/v1/chat/completions", json={"model": "echo", "messages": MESSAGES}).json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(body["choices"][0]) == {"index", "message", "logprobs", "finish_reason"}
    assert body["choices"][0]["message"] == {"role": "assistant",
                                             "content": " ".join(WORDS[:8])}


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=5)
    chunks = list(client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=5, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices[0].delta.content is None
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


def test_stream_sse_framing(http: httpx.Client) -> None:
    payload = {"model": "echo", "messages": MESSAGES, "max_tokens": 2, "stream": True,
               "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=payload) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"
    assert '"usage":null' in frames[0].replace(" ", "")


def test_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    *content, last = chunks
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (4, 4)
    assert all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == "length"


def test_no_usage_field_without_include_usage(http: httpx.Client) -> None:
    payload = {"model": "echo", "messages": MESSAGES, "max_tokens": 2, "stream": True}
    with http.stream("POST", "/v1/chat/completions", json=payload) as response:
        raw = response.read().decode()
    assert '"usage"' not in raw


def test_content_parts_and_roles(client: openai.OpenAI, echo_backends: dict) -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "one"},
                                     {"type": "text", "text": "two"}]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "three", "name": "bob"},
    ]
    out = client.chat.completions.create(model="echo", messages=messages, max_tokens=1)
    assert out.choices[0].message.content == "alpha"
    sent = echo_backends["echo"].requests[-1].messages
    assert sent[0] == {"role": "system", "content": "rules"}
    assert sent[1] == {"role": "user", "content": "one\ntwo"}
    assert sent[3] == {"role": "user", "content": "three", "name": "bob"}


def test_sampling_mapping(client: openai.OpenAI, echo_backends: dict) -> None:
    client.chat.completions.create(
        model="echo", messages=MESSAGES, max_completion_tokens=2, temperature=0, top_p=0.5,
        seed=7, stop=["zzz"], presence_penalty=0.5, user="u1",
        extra_body={"top_k": 20, "ignore_eos": True, "repetition_penalty": 1.1})
    sampling = echo_backends["echo"].requests[-1].sampling
    assert sampling.max_tokens == 2
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (0, 0.5, 20)
    assert (sampling.seed, sampling.stop, sampling.ignore_eos) == (7, ("zzz",), True)
    assert (sampling.presence_penalty, sampling.repetition_penalty) == (0.5, 1.1)


def test_defaults(client: openai.OpenAI, echo_backends: dict) -> None:
    client.chat.completions.create(model="echo", messages=MESSAGES)
    req = echo_backends["echo"].requests[-1]
    assert (req.sampling.temperature, req.sampling.top_p, req.sampling.max_tokens) == (1, 1, None)
    assert len(req.request_id) == 32


def test_stop_string(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="echo", messages=MESSAGES, stop="gamma")
    assert out.choices[0].message.content == "alpha beta "
    assert out.choices[0].finish_reason == "stop"


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=2,
                                         logprobs=True)
    content = out.choices[0].logprobs.content
    assert [t.token for t in content] == ["alpha", " beta"]
    assert all(t.logprob == -0.5 and t.top_logprobs == [] for t in content)
    chunks = list(client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=2, logprobs=True, stream=True))
    streamed = [t.token for c in chunks if c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert streamed == ["alpha", " beta"]


def test_x_model_header_wins(client: openai.OpenAI, echo_backends: dict) -> None:
    before = len(echo_backends["slow"].requests)
    out = client.chat.completions.create(
        model="echo", messages=MESSAGES, max_tokens=1, extra_headers={"x-model": "slow"})
    assert out.model == "slow"
    assert len(echo_backends["slow"].requests) == before + 1


def test_x_model_header_without_body_model(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", headers={"x-model": "echo"},
                         json={"messages": MESSAGES, "max_tokens": 1})
    assert response.status_code == 200
    assert response.json()["model"] == "echo"


def test_model_required_when_several(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"messages": MESSAGES})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "model"


def test_aliases_and_sole_model(serve_app) -> None:
    import tempfile
    from pathlib import Path

    from gateway.app import create_app
    from gateway.settings import Settings

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.yaml"
        path.write_text("models:\n  - name: echo\n    model_id: x\n    aliases: [e, gpt-4o]\n")
        app = create_app(Settings(config_file=path), backends={"echo": EchoBackend()})
    url = serve_app(app)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    out = client.chat.completions.create(model="gpt-4o", messages=MESSAGES, max_tokens=1)
    assert out.model == "echo"
    alias = client.models.retrieve("e")
    assert (alias.id, alias.alias_of) == ("e", "echo")
    response = httpx.post(f"{url}/v1/chat/completions", json={"messages": MESSAGES})
    assert response.status_code == 200, response.text
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-5", messages=MESSAGES)
