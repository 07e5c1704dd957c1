"""POST /v1/responses on the native engine through a real server, driven by the openai SDK:
whole and streamed answers, structured outputs, function calls and their outputs across
`previous_response_id`, stored responses, and bad input. Greedy answers are compared with
the chat route's for the same conversation, the reference path the translation targets."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.responses.conftest import MODEL, Serve, sdk

INSTRUCTIONS = "You describe cities."
QUESTION = "Describe a city in one JSON object."
CITY = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["name", "country", "population"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_weather", "description": "The weather of a city.",
        "parameters": WEATHER, "strict": True}
CHAT_TOOL = {"type": "function", "function": {"name": "get_weather",
                                              "description": "The weather of a city.",
                                              "parameters": WEATHER, "strict": True}}
FORCED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def client(serve: Serve, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    cache = tmp_path_factory.mktemp("cache")
    with serve(Settings(model_id="unused", cache_dir=str(cache))) as url:
        yield sdk(url)


def _create(client: openai.OpenAI, **extra: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **extra)


def _events(client: openai.OpenAI, **extra: Any) -> list[Any]:
    return list(_create(client, stream=True, **extra))


def _final(events: list[Any]) -> Any:
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events[-1].response


# -- whole and streamed ---------------------------------------------------------------------


def test_a_whole_answer_is_a_message_with_usage_and_the_request_echoed(
        client: openai.OpenAI) -> None:
    answer = _create(client, instructions=INSTRUCTIONS, input=QUESTION, max_output_tokens=6,
                     metadata={"case": "whole"}, user="u-1")
    assert answer.id.startswith("resp_") and answer.object == "response"
    assert answer.model == MODEL
    assert answer.status == "incomplete"  # random weights: the token limit ends it
    assert answer.incomplete_details.reason == "max_output_tokens"
    (message,) = answer.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete" and message.content[0].type == "output_text"
    assert answer.output_text == message.content[0].text != ""
    usage = answer.usage
    assert usage.output_tokens == 6 and usage.input_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert (answer.instructions, answer.max_output_tokens, answer.temperature) == (
        INSTRUCTIONS, 6, 0.0)
    assert answer.metadata == {"case": "whole"} and answer.user == "u-1"
    assert answer.store is True and answer.previous_response_id is None
    assert answer.tools == [] and answer.tool_choice == "auto"
    assert answer.text.format.type == "text" and answer.parallel_tool_calls is True


def test_a_stream_sends_the_typed_events_in_order_and_the_same_answer(
        client: openai.OpenAI) -> None:
    whole = _create(client, input=QUESTION, max_output_tokens=8)
    events = _events(client, input=QUESTION, max_output_tokens=8)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done",
                     "response.output_item.done", "response.incomplete"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text == events[-4].text
    final = _final(events)
    assert final.status == "incomplete" and final.output_text == whole.output_text
    assert final.usage.output_tokens == 8
    ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert ids == {final.output[0].id}


def test_the_sdk_stream_helper_accumulates_the_events(client: openai.OpenAI) -> None:
    """The SDK's own accumulator checks that every event fits the items announced (it needs
    `response.completed`: the schema's grammar ends the answer before the token limit)."""
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=120,
                                 text=_city_format(), temperature=0) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == text
    assert client.responses.retrieve(final.id).output_text == text


# -- the same path as chat completions -------------------------------------------------------


def test_greedy_answers_equal_the_chat_routes_for_the_same_conversation(
        client: openai.OpenAI) -> None:
    items = [
        {"role": "user", "content": QUESTION},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Paris, in France."}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Another"},
                                     {"type": "input_text", "text": "one?"}]},
    ]
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "Paris, in France."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Another\none?"},
    ]
    answer = _create(client, instructions=INSTRUCTIONS, input=items, max_output_tokens=12)
    chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                          max_tokens=12)
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


# -- structured outputs and function calls ---------------------------------------------------


def _city_format() -> dict[str, Any]:
    return {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}


def test_a_json_schema_answer_validates_whole_and_streamed(client: openai.OpenAI) -> None:
    answer = _create(client, input=QUESTION, text=_city_format(), max_output_tokens=120)
    assert answer.status == "completed" and answer.completed_at is not None
    jsonschema.validate(json.loads(answer.output_text), CITY)
    assert answer.text.format.type == "json_schema" and answer.text.format.name == "city"
    events = _events(client, input=QUESTION, text=_city_format(), max_output_tokens=120)
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == answer.output_text
    assert _final(events).status == "completed"


def test_a_forced_function_call_is_a_function_call_item(client: openai.OpenAI) -> None:
    answer = _create(client, input="Weather in Lima?", tools=[TOOL], tool_choice=FORCED,
                     max_output_tokens=120)
    (call,) = answer.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert call.status == "completed" and answer.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    assert answer.tools[0].name == "get_weather" and answer.tool_choice.name == "get_weather"


def test_a_streamed_function_call_sends_its_arguments_in_pieces(client: openai.OpenAI) -> None:
    events = _events(client, input="Weather in Lima?", tools=[TOOL], tool_choice="required",
                     parallel_tool_calls=False, max_output_tokens=120)
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.arguments == ""
    pieces = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert pieces == done.arguments and done.item_id == added.item.id
    (call,) = _final(events).output
    assert call.arguments == pieces and call.call_id == added.item.call_id
    jsonschema.validate(json.loads(pieces), WEATHER)


def test_a_function_output_continues_the_stored_conversation(client: openai.OpenAI) -> None:
    first = _create(client, input="Weather in Lima?", tools=[TOOL], tool_choice=FORCED,
                    max_output_tokens=120)
    (call,) = first.output
    result = json.dumps({"celsius": 21})
    second = _create(client, previous_response_id=first.id, tools=[TOOL],
                     input=[{"type": "function_call_output", "call_id": call.call_id,
                             "output": result}], max_output_tokens=10)
    assert second.previous_response_id == first.id and second.output_text
    listed = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in listed.data] == ["message", "function_call", "function_call_output"]
    assert listed.data[1].call_id == listed.data[2].call_id == call.call_id
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=10, tools=[
        CHAT_TOOL], messages=[
        {"role": "user", "content": "Weather in Lima?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert second.output_text == chat.choices[0].message.content


# -- stored responses -------------------------------------------------------------------------


def test_a_stored_response_is_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    first = _create(client, input="One", max_output_tokens=3)
    second = _create(client, previous_response_id=first.id, input="Two", max_output_tokens=3)
    assert client.responses.retrieve(second.id).model_dump() == second.model_dump()
    newest_first = client.responses.input_items.list(second.id)
    texts = [i.content[0].text for i in newest_first.data]
    assert texts == ["Two", first.output_text, "One"]
    one = client.responses.input_items.list(second.id, limit=1, order="asc")
    assert one.has_more and one.data[0].content[0].text == "One"
    after = client.responses.input_items.list(second.id, limit=5, order="asc",
                                              after=one.data[0].id)
    assert [i.id for i in after.data] == [i.id for i in reversed(newest_first.data[:2])]
    assert not after.has_more
    client.responses.delete(second.id)
    for call in (lambda: client.responses.retrieve(second.id),
                 lambda: client.responses.delete(second.id),
                 lambda: client.responses.input_items.list(second.id),
                 lambda: _create(client, previous_response_id=second.id, input="Three")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert client.responses.retrieve(first.id).id == first.id


def test_store_false_keeps_nothing(client: openai.OpenAI) -> None:
    answer = _create(client, input="One", max_output_tokens=2, store=False)
    assert answer.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(answer.id)


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("extra", "param"), [
    ({"input": [{"type": "computer_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "hi", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "background": True}, "background"),
    ({}, "input"),
    # Refused by the engine, which names the chat request's fields: renamed.
    ({"input": "word " * 600}, "input"),
    ({"input": "hi", "max_output_tokens": 600}, "max_output_tokens"),
])
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, extra: dict[str, Any],
                                             param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, **extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_an_unknown_previous_response_is_a_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        _create(client, previous_response_id="resp_unknown", input="hi")
    assert caught.value.body["param"] == "previous_response_id"
    assert "resp_unknown" in caught.value.body["message"]


def test_the_store_file_is_under_the_cache_directory(client: openai.OpenAI,
                                                     tmp_path_factory: pytest.TempPathFactory,
                                                     ) -> None:
    folders = list(Path(tmp_path_factory.getbasetemp()).glob("cache*/responses.sqlite3"))
    assert folders, "no responses.sqlite3 under the cache directory"


# -- a remote deployment ----------------------------------------------------------------------


def test_a_remote_deployment_gets_the_chat_completion_it_amounts_to(
        serve: Serve, model_dir: Path, tmp_path: Path) -> None:
    with serve(Settings(model_id="unused", cache_dir=str(tmp_path / "upstream"))) as upstream:
        config = tmp_path / "models.yaml"
        config.write_text(
            f"models:\n  - name: {MODEL}\n    deployments:\n"
            f"      - {{backend: remote, name: up, base_url: '{upstream}/v1', model: {MODEL}, "
            f"tokenizer: '{model_dir}', max_total_tokens: 512}}\n")
        settings = Settings(config_file=config, cache_dir=str(tmp_path / "front"))
        with running_server(create_app(settings), timeout_s=60) as front:
            kwargs: dict[str, Any] = {"instructions": INSTRUCTIONS, "input": QUESTION,
                                      "max_output_tokens": 8}
            remote = _create(sdk(front), **kwargs)
            local = _create(sdk(upstream), **kwargs)
            streamed = _events(sdk(front), **kwargs)
        metrics = httpx.get(f"{upstream}/metrics", timeout=10).text
    assert remote.output_text == local.output_text == _final(streamed).output_text
    assert remote.status == "incomplete" and remote.usage.output_tokens == 8
    chats = re.findall(r'switchyard_requests_total\{model="[^"]*",route="/v1/chat/completions"'
                       r',status="200"\} ([\d.]+)', metrics)
    assert chats == ["2.0"], metrics  # the front's two requests, as chat completions
