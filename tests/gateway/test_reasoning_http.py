"""A thinking model's reasoning through the real server, driven by the openai SDK.

The model (tests/gateway/thinking_model.py) is a hand-set tiny Llama whose greedy output is
`<think>So ok</think>Hello world`: chat answers split it into `reasoning_content` and
`content`, TGI's routes and /v1/completions return it as generated.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.thinking_model import (
    CONTENT,
    NO_THINKING,
    REASONING,
    REASONING_TOKENS,
    write_thinking_model,
)

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Say hello."}]
RAW = f"<think>{REASONING}</think>{CONTENT}"
SCHEMA = {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"], "additionalProperties": False,
}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[str]:
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir)
    config = EngineConfig(model=str(folder), served_model_name=MODEL, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
                          compile=False)
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=600) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20,
                                          temperature=0, **extra)


def _streamed(client: openai.OpenAI, **extra: Any) -> tuple[str, str, Any]:
    """(reasoning, content, usage) of a streamed answer, its deltas concatenated."""
    reasoning, content, usage = [], [], None
    for chunk in _chat(client, stream=True, stream_options={"include_usage": True}, **extra):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    return "".join(reasoning), "".join(content), usage


def test_whole_answer_splits_reasoning_from_content(client: openai.OpenAI) -> None:
    answer = _chat(client)
    message = answer.choices[0].message
    assert message.reasoning_content == REASONING
    assert message.content == CONTENT
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.completion_tokens == REASONING_TOKENS + 3  # Hello, world, eos
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_streamed_reasoning_equals_whole(client: openai.OpenAI) -> None:
    whole = _chat(client).choices[0].message
    reasoning, content, usage = _streamed(client)
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_enable_thinking_false_renders_a_closed_reasoning(client: openai.OpenAI) -> None:
    thinking = _chat(client)
    plain = _chat(client, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    # The template added `<think>\n\n</think>\n\n` (4 tokens) to the prompt.
    assert plain.usage.prompt_tokens == thinking.usage.prompt_tokens + 4
    assert plain.choices[0].message.content == NO_THINKING
    assert plain.choices[0].message.reasoning_content is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_prompt_that_opens_the_reasoning_starts_inside_it(client: openai.OpenAI) -> None:
    answer = _chat(client, extra_body={"chat_template_kwargs": {"think_in_prompt": True}})
    assert answer.choices[0].message.reasoning_content == REASONING
    assert answer.choices[0].message.content == CONTENT
    # The start marker was the prompt's: So, ok, </think>.
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS - 1
    reasoning, content, _ = _streamed(
        client, extra_body={"chat_template_kwargs": {"think_in_prompt": True}})
    assert (reasoning, content) == (REASONING, CONTENT)


def test_include_reasoning_false_drops_it(client: openai.OpenAI) -> None:
    answer = _chat(client, extra_body={"include_reasoning": False})
    message = answer.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert message.content == CONTENT
    assert answer.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    reasoning, content, _ = _streamed(client, extra_body={"include_reasoning": False})
    assert (reasoning, content) == ("", CONTENT)


@pytest.mark.parametrize("kwargs", [[1, 2], "enable_thinking", {"tools": []},
                                    {"add_generation_prompt": False}])
def test_bad_chat_template_kwargs_are_a_400(client: openai.OpenAI, kwargs: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _chat(client, extra_body={"chat_template_kwargs": kwargs})
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_json_schema_constrains_the_answer_not_the_reasoning(client: openai.OpenAI) -> None:
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "yes_no", "schema": SCHEMA, "strict": True}}
    for extra in ({}, {"extra_body": {"chat_template_kwargs": {"think_in_prompt": True}}}):
        answer = _chat(client, response_format=response_format, **extra)
        message = answer.choices[0].message
        assert message.reasoning_content == REASONING  # free text: no grammar while reasoning
        jsonschema.validate(json.loads(message.content), SCHEMA)
        reasoning, content, _ = _streamed(client, response_format=response_format, **extra)
        assert (reasoning, content) == (message.reasoning_content, message.content)
    # Told not to think, the model answers at once, under the grammar.
    plain = _chat(client, response_format=response_format,
                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain.choices[0].message.reasoning_content is None
    jsonschema.validate(json.loads(plain.choices[0].message.content), SCHEMA)


def test_completions_return_the_text_as_generated(client: openai.OpenAI) -> None:
    answer = client.completions.create(model=MODEL, prompt="Say hello\n", max_tokens=20,
                                       temperature=0)
    assert answer.choices[0].text == RAW


def test_tgi_routes_return_the_text_as_generated(base_url: str) -> None:
    body = {"inputs": "Say hello\n", "parameters": {"max_new_tokens": 20, "details": True}}
    whole = httpx.post(f"{base_url}/generate", json=body, timeout=60).json()
    assert whole["generated_text"] == RAW
    assert [t["text"] for t in whole["details"]["tokens"]][:2] == ["<think>", "So"]
    events = []
    with httpx.stream("POST", f"{base_url}/generate_stream", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[5:]))
    assert "".join(e["token"]["text"] for e in events if not e["token"]["special"]) == RAW
    assert events[-1]["generated_text"] == RAW
    assert set(events[-1]) >= {"token", "generated_text"}
    assert not any("reasoning" in key for e in events for key in e)


def test_each_choice_splits_its_own_text(client: openai.OpenAI) -> None:
    answer = _chat(client, n=2)
    assert [(c.message.reasoning_content, c.message.content) for c in answer.choices] == [
        (REASONING, CONTENT)] * 2
    assert answer.usage.completion_tokens_details.reasoning_tokens == 2 * REASONING_TOKENS


def test_an_earlier_answers_reasoning_reaches_the_template(client: openai.OpenAI) -> None:
    def ask(assistant: dict[str, Any]) -> Any:
        messages = [*MESSAGES, assistant, {"role": "user", "content": "Again."}]
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                              temperature=0)

    plain = ask({"role": "assistant", "content": CONTENT})
    recalled = ask({"role": "assistant", "content": CONTENT, "reasoning_content": REASONING})
    # <think> So ok </think> rendered back; the prompt's closed reasoning is not the answer's.
    assert recalled.usage.prompt_tokens == plain.usage.prompt_tokens + REASONING_TOKENS
    message = recalled.choices[0].message
    assert (message.reasoning_content, message.content) == (REASONING, CONTENT)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, max_tokens=5, messages=[
            {"role": "user", "content": "x", "reasoning_content": "y"}])
