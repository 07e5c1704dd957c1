"""Client mistakes: 4xx in OpenAI's error shape, naming the field; never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MESSAGES = [{"role": "user", "content": "hi"}]


def _error(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_unknown_model_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", stream=True)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_unknown_model_in_header_404(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", headers={"x-model": "ghost"},
                         json={"model": "echo", "messages": MESSAGES})
    assert response.status_code == 404
    assert _error(response)["code"] == "model_not_found"


@pytest.mark.parametrize(("extra", "param"), [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -3}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"seed": 2**70}, "seed"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": "hello"}, "messages"),
    ({"messages": ["hello"]}, "messages[0]"),
    ({"tools": ["f"]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice"),
    ({"tool_choice": "auto", "tools": [], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"logit_bias": {"token": -100}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": []}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a",
                                                                  "strict": "yes"}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "json": {}}}, "structured_outputs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"top_logprobs": 3, "logprobs": False}, "top_logprobs"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
    ({"min_p": 1.5}, "min_p"),
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids"),
    ({"model": 5}, "model"),
])
def test_chat_validation_400(http: httpx.Client, extra: dict, param: str | None) -> None:
    body = {"model": "echo", "messages": MESSAGES, **extra}
    response = http.post("/v1/chat/completions", json=body)
    if param is None:  # accepted
        assert response.status_code == 200, response.text
        return
    assert response.status_code == 400, response.text
    error = _error(response)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[-1] in error["message"]


def test_n_message(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions",
                         json={"model": "echo", "messages": MESSAGES, "n": 17})
    assert "n must be between 1 and 16" in _error(response)["message"]


def test_logit_bias_message_names_the_key(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={
        "model": "echo", "messages": MESSAGES, "logit_bias": {"12": 1, "dog": 3}})
    assert "'dog'" in _error(response)["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"echo": True}, "echo"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 17}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": True}, "logprobs"),
    ({"n": 17}, "n"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"suffix": "end"}, "suffix"),
])
def test_completion_validation_400(http: httpx.Client, extra: dict, param: str) -> None:
    body = {"model": "echo", "prompt": "x", **extra}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert _error(response)["param"] == param


def test_sdk_raises_bad_request_with_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo", messages=MESSAGES, temperature=3)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="echo", messages=MESSAGES, n=17, stream=True)
    assert info.value.param == "n"


def test_context_window_error_from_backend(client: openai.OpenAI) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model="echo", messages=MESSAGES, max_tokens=100, stream=stream)
        assert info.value.param == "max_tokens"
        assert info.value.code == "context_length_exceeded"
        assert "maximum context length" in info.value.message


def test_backend_unavailable_is_503(http: httpx.Client) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "UNAVAILABLE"}]}
    for stream in (False, True):
        response = http.post("/v1/chat/completions", json={**body, "stream": stream})
        assert response.status_code == 503
        assert response.headers["retry-after"] == "1"


def test_failure_midway(http: httpx.Client, client: openai.OpenAI) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "FAIL_MIDWAY"}]}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 500
    assert _error(response)["type"] == "api_error"
    # Streamed: the status is already 200, the error arrives as an event the SDK raises.
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="echo", stream=True,
                                            messages=body["messages"]))
    # ...and the gateway still serves.
    assert client.chat.completions.create(model="echo", messages=MESSAGES).choices


def test_abort_finish(http: httpx.Client) -> None:
    body = {"model": "echo", "messages": [{"role": "user", "content": "ABORT_NOW"}]}
    assert http.post("/v1/chat/completions", json=body).status_code == 503
    raw = http.post("/v1/chat/completions", json={**body, "stream": True}).text
    frames = [json.loads(f[6:]) for f in raw.split("\n\n") if f and f != "data: [DONE]"]
    assert frames[-1]["error"]["code"] == "request_aborted"
    assert raw.endswith("data: [DONE]\n\n")


def test_unsupported_but_harmless_fields_are_accepted(http: httpx.Client) -> None:
    body = {"model": "echo", "messages": MESSAGES, "user": "u", "presence_penalty": 1,
            "frequency_penalty": -1, "stream_options": {"include_usage": False},
            "metadata": {"a": "b"}, "store": False, "parallel_tool_calls": True,
            "tool_choice": "none", "tools": [], "logit_bias": {}, "service_tier": "auto",
            "response_format": {"type": "text"}, "logprobs": False, "top_logprobs": 0,
            "n": 1, "stop": None, "seed": None, "reasoning_effort": "low", "min_tokens": 0,
            "min_p": 0, "structured_outputs": None, "guided_json": None,
            "some_future_field": 1}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text


GARBAGE_BODIES: list[bytes | str] = [
    b"", b"   ", b"{", b"not json", b"null", b"[]", b"[1, 2]", b"42", b'"string"', b"true",
    b"\xff\xfe\x00", "{\"model\": \"echo\", \"messages\": [{\"role\": \"user\", "
    "\"content\": \"\\ud800\"}]}",
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e999}',
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": '
    + b"9" * 5000 + b"}",
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 10**30}),
    json.dumps({"model": "echo", "messages": [{"role": "user", "content": "hi"}],
                "top_k": -5}),
    json.dumps({"model": None, "messages": None}),
    json.dumps({"model": ["echo"], "messages": MESSAGES}),
    json.dumps({"model": "echo", "messages": [None]}),
    json.dumps({"model": "echo", "messages": [[]]}),
    json.dumps({"model": "echo", "messages": [{"role": None, "content": "x"}]}),
    json.dumps({"model": "echo", "messages": [{"role": "user", "content": [None]}]}),
    json.dumps({"model": "echo", "messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    json.dumps({"model": "echo", "messages": [{"role": "user", "content": {}}]}),
    json.dumps({"model": "echo", "messages": MESSAGES, "stream_options": "x"}),
    json.dumps({"model": "echo", "messages": MESSAGES, "stream_options": {"include_usage": 1}}),
    json.dumps({"model": "echo", "messages": MESSAGES, "stop": [1]}),
    json.dumps({"model": "echo", "messages": MESSAGES, "stop": {"a": 1}}),
    json.dumps({"model": "echo", "messages": MESSAGES, "logit_bias": [1]}),
    json.dumps({"model": "echo", "messages": MESSAGES, "tools": "all"}),
    json.dumps({"model": "echo", "messages": MESSAGES, "response_format": "json"}),
    json.dumps({"model": "echo", "messages": MESSAGES, "stop_token_ids": [-1]}),
    json.dumps({"model": "echo", "messages": MESSAGES, "n": None, "max_tokens": None}),
    json.dumps({"model": "", "messages": MESSAGES}),
    json.dumps({"model": "echo", "prompt": "x", "messages": MESSAGES, "x" * 1000: 1}),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
def test_garbage_never_500(http: httpx.Client, path: str, content_type: str | None) -> None:
    headers = {"content-type": content_type} if content_type else {}
    for raw in GARBAGE_BODIES:
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        response = http.post(path, content=data, headers=headers)
        assert response.status_code < 500, (raw[:200], response.text)
        if response.status_code >= 400:
            _error(response)


def test_garbage_headers_and_methods(http: httpx.Client) -> None:
    assert http.get("/v1/chat/completions").status_code == 405
    assert http.post("/v1/nothing-here", json={}).status_code == 404
    response = http.post("/v1/chat/completions", headers={"x-model": ""},
                         json={"model": "echo", "messages": MESSAGES})
    assert response.status_code == 200
    _error(http.get("/v1/chat/completions"))
