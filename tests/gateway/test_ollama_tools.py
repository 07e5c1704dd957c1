"""Tool calls through Ollama's /api/chat, with the real `ollama` client and a real uvicorn
server: a scripted backend "says" a Hermes `<tool_call>` (a random model calls no tool), and
records what the chat template was given for the tool history."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import ollama
import pytest

from backends.base import GenerationEvent, GenerationRequest, TokenInfo
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.scripted_backend import ScriptedBackend

HERMES = ["Let me check. ", "<tool_call>", '\n{"name": "get_weather", ', '"arguments": ',
          '{"city": ', '"Oslo", "days": 2}}', "\n</tool_call>"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
QUESTION = {"role": "user", "content": "Weather in Oslo?"}


@pytest.fixture
def served(serve_app: ServeApp) -> tuple[ollama.Client, ScriptedBackend]:
    backend = ScriptedBackend(HERMES)
    url = serve_app(create_app(Settings(), backends={"scripted": backend}))
    return ollama.Client(host=url, timeout=10), backend


def _calls(message: ollama.Message) -> list[tuple[str, dict[str, Any]]]:
    return [(call.function.name, dict(call.function.arguments))
            for call in message.tool_calls or []]


def test_a_call_comes_in_ollamas_shape(served) -> None:
    client, _ = served
    answer = client.chat(model="scripted:latest", messages=[QUESTION], tools=[WEATHER])
    assert _calls(answer.message) == [("get_weather", {"city": "Oslo", "days": 2})]
    assert answer.message.content == "Let me check. "
    assert answer.done_reason == "stop"
    parts = list(client.chat(model="scripted", messages=[QUESTION], tools=[WEATHER],
                             stream=True))
    calls = [call for part in parts for call in _calls(part.message)]
    assert calls == [("get_weather", {"city": "Oslo", "days": 2})]
    assert "".join(p.message.content or "" for p in parts) == "Let me check. "
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_the_call_and_its_result_reach_the_template(served) -> None:
    """The history as Ollama's clients send it: calls without ids, results by tool name."""
    client, backend = served
    answer = client.chat(model="scripted", messages=[QUESTION], tools=[WEATHER])
    history = [QUESTION, answer.message,
               {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 21 degrees."}]
    client.chat(model="scripted", messages=history, tools=[WEATHER])
    sent = backend.requests[-1].messages
    assert sent is not None
    (call,) = sent[-2]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    assert sent[-1] == {"role": "tool", "tool_call_id": call["id"], "name": "get_weather",
                        "content": "Sunny, 21 degrees."}
    assert backend.requests[-1].tools is not None  # the template renders them


def test_a_result_answers_the_call_of_its_tool(served) -> None:
    client, backend = served
    calls = [{"function": {"name": "get_time", "arguments": {}}},
             {"function": {"name": "get_weather", "arguments": {"city": "Lima"}}}]
    history = [QUESTION, {"role": "assistant", "content": "", "tool_calls": calls},
               {"role": "tool", "tool_name": "get_weather", "content": "Rain."},
               {"role": "tool", "content": "Noon."}]
    client.chat(model="scripted", messages=history, tools=[WEATHER])
    sent = backend.requests[-1].messages
    assert sent is not None
    ids = {c["function"]["name"]: c["id"] for c in sent[1]["tool_calls"]}
    assert len(set(ids.values())) == 2
    assert sent[2]["tool_call_id"] == ids["get_weather"]
    assert sent[3]["tool_call_id"] == ids["get_time"] and sent[3]["name"] == "get_time"


class FailingBackend(ScriptedBackend):
    """Says its first piece, then fails the generation (as an engine error ends it)."""

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        yield GenerationEvent(text=self.pieces[0], tokens=(TokenInfo(id=0, text="x"),))
        yield GenerationEvent(finish_reason="error")


def test_a_failure_after_the_stream_started_is_an_error_line(serve_app: ServeApp) -> None:
    url = serve_app(create_app(Settings(), backends={"failing": FailingBackend(["Hel"])}))
    client = ollama.Client(host=url, timeout=10)
    parts = client.chat(model="failing", messages=[QUESTION], stream=True)
    assert next(parts).message.content == "Hel"
    with pytest.raises(ollama.ResponseError) as failed:
        next(parts)
    assert "failed while generating" in failed.value.error
    with pytest.raises(ollama.ResponseError) as whole:  # not streamed: the status says it
        client.chat(model="failing", messages=[QUESTION])
    assert whole.value.status_code == 500
