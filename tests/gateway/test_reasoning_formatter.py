"""The chat formatter with a thinking model's split text: tool calls are parsed from the
content only (a call the model merely considers while reasoning is no call), whole and
streamed; reasoning goes to `reasoning_content`."""

from __future__ import annotations

from backends.base import GenerationEvent, ReasoningSplit, Usage
from gateway.generation import Collected
from gateway.openai.responses import ChatFormatter, ResponseMeta, ResponseOptions
from gateway.openai.tools import plan_tools

TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}, "required": ["zone"]}}}
CALL = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
# (reasoning, content) of each event: the reasoning drafts a call; the answer makes one.
PARTS = ((f"Maybe {CALL[:20]}", ""), (f"{CALL[20:]} no.", ""), ("", "Sure. "), ("", CALL))


def _formatter() -> ChatFormatter:
    plan = plan_tools([TOOL], "auto", True, None)
    return ChatFormatter(ResponseMeta("id", "m"), ResponseOptions(), plan)


def _events() -> list[GenerationEvent]:
    events = [GenerationEvent(text="raw", split=ReasoningSplit(r, c)) for r, c in PARTS]
    last = GenerationEvent(finish_reason="stop", usage=Usage(3, 9, 5), split=ReasoningSplit())
    return [*events, last]


def test_whole_answer_parses_calls_from_the_content_only() -> None:
    choice = Collected()
    for event in _events():
        choice.add(event)
    body = _formatter().body([choice], Usage(3, 9, 5))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == f"Maybe {CALL} no."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert message["content"] == "Sure. "
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}


def test_streamed_answer_parses_calls_from_the_content_only() -> None:
    formatter = _formatter()
    deltas = []
    for event in _events():
        deltas += [c["choices"][0]["delta"] for c in formatter.delta_chunks(
            0, event.text, event.tokens, event.split)]
        if event.finish_reason:
            deltas += [c["choices"][0]["delta"] for c in formatter.finish_chunks(0, "stop")]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert reasoning == f"Maybe {CALL} no."
    assert [c["function"]["name"] for c in calls if "name" in c.get("function", {})] == [
        "get_time"]
    assert "raw" not in "".join(d.get("content") or "" for d in deltas)
