"""Tool calls over a real server and the openai SDK, from a scripted backend whose model
"says" Hermes `<tool_call>` text (or the forced-call JSON array): message.tool_calls,
streamed delta.tool_calls fragments, finish_reason, the tool history, and the 400s."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.scripted_backend import ScriptedBackend

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {}}}}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
HERMES = ["Let me check. ", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": ',
          '{"city": ', '"Paris"}}', "\n</tool_call>"]
FORCED = ['[{"name": "get_weather", ', '"arguments": {"city": ', '"Oslo"}}]']


def _serve(serve_app: ServeApp, pieces: Sequence[str]) -> tuple[openai.OpenAI, ScriptedBackend,
                                                                 str]:
    backend = ScriptedBackend(pieces)
    url = serve_app(create_app(Settings(), backends={"scripted": backend}))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0), backend, url


def test_hermes_call_whole(serve_app: ServeApp) -> None:
    client, backend, _ = _serve(serve_app, HERMES)
    out = client.chat.completions.create(model="scripted", messages=MESSAGES,
                                         tools=[WEATHER, TIME])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name) == ("function", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert call.id.startswith("call_")
    sent = backend.requests[-1]
    assert [t["function"]["name"] for t in sent.tools] == ["get_weather", "get_time"]
    assert sent.sampling.structured is None  # "auto": nothing forced


def test_only_a_call_has_null_content(serve_app: ServeApp, ) -> None:
    _, _, url = _serve(serve_app, HERMES[1:])
    body = httpx.post(f"{url}/v1/chat/completions", json={
        "model": "scripted", "messages": MESSAGES, "tools": [WEATHER]}).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert set(message) == {"role", "content", "tool_calls"}
    assert set(message["tool_calls"][0]) == {"id", "type", "function"}


def _streamed_calls(chunks: list) -> tuple[dict[int, str], dict[int, list[dict]], dict]:
    """Per choice: the content, the tool calls rebuilt from fragments, the finish reasons."""
    content: dict[int, str] = defaultdict(str)
    calls: dict[int, list[dict]] = defaultdict(list)
    finish: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            content[choice.index] += choice.delta.content or ""
            for fragment in choice.delta.tool_calls or []:
                mine = calls[choice.index]
                if fragment.index == len(mine):  # a new call: id, type and name come first
                    assert fragment.id and fragment.type == "function"
                    mine.append({"id": fragment.id, "name": fragment.function.name,
                                 "arguments": ""})
                mine[fragment.index]["arguments"] += fragment.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return dict(content), dict(calls), finish


def test_streamed_fragments_build_the_same_call(serve_app: ServeApp) -> None:
    client, _, _ = _serve(serve_app, HERMES)
    whole = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER],
                                           n=2)
    chunks = list(client.chat.completions.create(model="scripted", messages=MESSAGES,
                                                 tools=[WEATHER], n=2, stream=True))
    content, calls, finish = _streamed_calls(chunks)
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for choice in whole.choices:
        assert content[choice.index] == choice.message.content
        [streamed] = calls[choice.index]
        [call] = choice.message.tool_calls
        assert (streamed["name"], streamed["arguments"]) == (call.function.name,
                                                            call.function.arguments)


def test_tool_choice_none_leaves_the_text_alone(serve_app: ServeApp) -> None:
    client, backend, _ = _serve(serve_app, HERMES)
    out = client.chat.completions.create(model="scripted", messages=MESSAGES, tools=[WEATHER],
                                         tool_choice="none")
    assert out.choices[0].message.content == "".join(HERMES)
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"
    assert backend.requests[-1].tools is None  # the model is told of no tools


@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_is_constrained_and_parsed(serve_app: ServeApp, tool_choice) -> None:
    client, backend, _ = _serve(serve_app, FORCED)
    for stream in (False, True):
        kwargs = {"model": "scripted", "messages": MESSAGES, "tools": [WEATHER, TIME],
                  "tool_choice": tool_choice}
        if stream:
            _, calls, finish = _streamed_calls(list(client.chat.completions.create(
                **kwargs, stream=True)))
            [call] = calls[0]
            name, arguments, reason = call["name"], call["arguments"], finish[0]
        else:
            choice = client.chat.completions.create(**kwargs).choices[0]
            [call] = choice.message.tool_calls
            name, arguments, reason = call.function.name, call.function.arguments, \
                choice.finish_reason
        assert (name, json.loads(arguments), reason) == (
            "get_weather", {"city": "Oslo"}, "tool_calls")
        structured = backend.requests[-1].sampling.structured
        assert structured is not None and structured.kind == "json_schema"
        assert json.loads(structured.spec)["type"] == "array"


def test_tool_history_round_trip(serve_app: ServeApp) -> None:
    client, backend, _ = _serve(serve_app, ["It is sunny."])
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
    ]
    out = client.chat.completions.create(model="scripted", messages=history, tools=[WEATHER])
    assert (out.choices[0].message.content, out.choices[0].finish_reason) == (
        "It is sunny.", "stop")
    sent = backend.requests[-1].messages
    assert sent[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert sent[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"}
    # Without tools in this request the history is still accepted.
    again = client.chat.completions.create(model="scripted", messages=history)
    assert again.choices[0].message.content == "It is sunny."


@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_tool_mistakes_are_400s(serve_app: ServeApp, extra: dict, param: str) -> None:
    _, _, url = _serve(serve_app, HERMES)
    response = httpx.post(f"{url}/v1/chat/completions",
                          json={"model": "scripted", "messages": MESSAGES, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_the_models_file_parser_override_reaches_the_route(serve_app: ServeApp, tmp_path) -> None:
    """`tool_call_parser: mistral` for a model whose (Hermes) output then is plain content."""
    config = tmp_path / "models.yaml"
    config.write_text("models:\n  - name: scripted\n    model_id: /unused\n"
                      "    tool_call_parser: mistral\n")
    url = serve_app(create_app(Settings(config_file=config),
                               backends={"scripted": ScriptedBackend(HERMES)}))
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0)
    choice = client.chat.completions.create(model="scripted", messages=MESSAGES,
                                            tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == "".join(HERMES)
