"""Issue 11 end to end: n, logprobs, logit_bias, structured outputs and forced tool calls on the
real engine behind a real server, driven by the openai SDK, checked against references.

The model is a tiny random Llama (tests/conftest.py) with the default model's real tokenizer,
so constrained decoding is exercised on weights that know nothing about JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Describe a city in one JSON object."}]

CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "enum": ["France", "Japan", "Peru"]},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
        "coastal": {"type": "boolean"},
        "districts": {
            "type": "array", "maxItems": 3,
            "items": {"type": "object", "properties": {"id": {"type": "integer",
                                                              "minimum": 0, "maximum": 99}},
                      "required": ["id"], "additionalProperties": False},
        },
    },
    "required": ["name", "country", "population", "coastal", "districts"],
    "additionalProperties": False,
}

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "JST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    config = EngineConfig(
        model=str(model_dir), served_model_name=MODEL, dtype="float32",
        max_total_tokens=512, max_batch_total_tokens=8192, block_size=8,
    )
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(model_dir)


# -- n -------------------------------------------------------------------------------------


def test_n_greedy_choices_are_identical(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, n=3, temperature=0, max_tokens=12,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = {c.message.content for c in out.choices}
    assert len(texts) == 1
    single = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
    )
    assert texts == {single.choices[0].message.content}
    assert out.usage.prompt_tokens == single.usage.prompt_tokens
    assert out.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_n_seeded_choices_are_distinct_and_reproducible(client: openai.OpenAI) -> None:
    def run() -> list[str]:
        out = client.completions.create(
            model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=1234,
            max_tokens=10, extra_body={"ignore_eos": True},
        )
        return [c.text for c in sorted(out.choices, key=lambda c: c.index)]

    first = run()
    assert len(set(first)) == 3
    assert run() == first


def test_n_streamed_equals_whole(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, prompt="The sea", n=2, temperature=0.8, seed=7, max_tokens=10)
    whole = client.completions.create(**kwargs)
    streamed = ["", ""]
    finishes = [None, None]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert streamed == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert all(finishes)


# -- logprobs ------------------------------------------------------------------------------


def _reference_steps(reference, prompt_ids: list[int], steps: int) -> list[torch.Tensor]:
    """transformers' greedy continuation: log_softmax (float32) at each generated position."""
    model, _ = reference
    ids = torch.tensor([prompt_ids])
    rows = []
    with torch.no_grad():
        for _ in range(steps):
            logprobs = torch.log_softmax(model(ids).logits[0, -1].float(), dim=-1)
            rows.append(logprobs)
            ids = torch.cat([ids, logprobs.argmax().view(1, 1)], dim=1)
    return rows


def test_chat_top_logprobs_match_transformers(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8, logprobs=True,
        top_logprobs=5, extra_body={"ignore_eos": True},
    )
    content = out.choices[0].logprobs.content
    rows = _reference_steps(reference, list(prompt_ids), len(content))
    for position, row in zip(content, rows, strict=True):
        values, ids = row.topk(5)
        assert position.logprob == pytest.approx(values[0].item(), abs=1e-4)
        assert [t.logprob for t in position.top_logprobs] == pytest.approx(values.tolist(),
                                                                           abs=1e-4)
        texts = [t.token for t in position.top_logprobs]
        assert position.token in texts  # the chosen token is among the alternatives
        assert texts[0] == tokenizer.decode([ids[0].item()])


def test_completion_logprobs_match_transformers(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    prompt_ids = tokenizer.encode("The history of")
    out = client.completions.create(
        model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=6, logprobs=3,
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    rows = _reference_steps(reference, prompt_ids, len(logprobs.tokens))
    offsets = [0]
    for token in logprobs.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs.text_offset == offsets
    for chosen, top, row in zip(logprobs.token_logprobs, logprobs.top_logprobs, rows,
                                strict=True):
        values, _ = row.topk(3)
        assert chosen == pytest.approx(values[0].item(), abs=1e-4)
        assert sorted(top.values(), reverse=True) == pytest.approx(values.tolist(), abs=1e-4)


def test_streamed_logprobs_equal_whole(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=10, logprobs=True,
                  top_logprobs=3)
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            if choice.logprobs and choice.logprobs.content:
                streamed.extend(choice.logprobs.content)
    assert [p.model_dump() for p in streamed] == [p.model_dump() for p in whole]


# -- logit_bias ----------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(client: openai.OpenAI, reference) -> None:
    _, tokenizer = reference
    (token,) = tokenizer.encode(" cat")
    forced = client.completions.create(
        model=MODEL, prompt="A", temperature=0, max_tokens=4, logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert forced.choices[0].text == " cat" * 4
    greedy = client.completions.create(model=MODEL, prompt="A", temperature=0, max_tokens=1)
    first = tokenizer.encode(greedy.choices[0].text)[0]
    banned = client.completions.create(
        model=MODEL, prompt="A", temperature=0, max_tokens=1, logit_bias={str(first): -100},
    )
    assert banned.choices[0].text != greedy.choices[0].text


# -- structured outputs --------------------------------------------------------------------


def test_json_schema_strict_always_validates(client: openai.OpenAI) -> None:
    answers = []
    for seed in range(5):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=10, temperature=1.0, seed=seed, max_tokens=300,
            response_format={"type": "json_schema", "json_schema": {
                "name": "city", "schema": CITY_SCHEMA, "strict": True}},
        )
        answers += out.choices
    assert len(answers) == 50
    for choice in answers:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), CITY_SCHEMA)


def test_json_object_always_parses(client: openai.OpenAI, reference) -> None:
    # Nothing bounds a json_object's strings, and inside one a random model almost never
    # picks a closing quote among ~49k allowed tokens: a bias on `"` keeps answers short
    # enough to finish. Validity still comes from the grammar alone.
    quote = reference[1].convert_tokens_to_ids('"')
    answers = []
    for seed in range(5):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=10, temperature=1.0, seed=seed, max_tokens=400,
            response_format={"type": "json_object"}, logit_bias={str(quote): 8},
        )
        answers += out.choices
    for choice in answers:
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(json.loads(choice.message.content), dict)


def test_an_unusable_schema_is_a_400_naming_the_problem(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=5,
            response_format={"type": "json_schema", "json_schema": {
                "name": "bad", "schema": {"type": "object", "properties": {
                    "x": {"type": "string", "pattern": "(unclosed"}}}}},
        )
    assert err.value.body["param"] == "response_format"
    assert "unclosed group" in err.value.body["message"]
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


# -- tools ---------------------------------------------------------------------------------


def _check_calls(message, allowed: set[str]) -> None:
    assert message.tool_calls, message.content
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_named_tool_choice_always_yields_a_valid_call(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(2):
        out = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=named,
            n=10, temperature=1.0, seed=seed, max_tokens=200,
        )
        for choice in out.choices:
            assert choice.finish_reason in ("tool_calls", "stop")
            _check_calls(choice.message, {"get_weather"})


def test_required_tool_choice_always_yields_a_valid_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
        n=10, temperature=1.0, seed=3, max_tokens=250,
    )
    for choice in out.choices:
        _check_calls(choice.message, {"get_weather", "get_time"})


def test_streamed_tool_call_deltas_concatenate_to_the_call(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER_TOOL], max_tokens=200,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}},
                  temperature=0.9, seed=11)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                if delta.function.name:
                    call["name"] += delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_a_forced_call_the_engine_cannot_compile_is_a_400_naming_tools(
    client: openai.OpenAI,
) -> None:
    broken = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(unclosed"}}}}}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[broken],
                                       tool_choice="required", max_tokens=5)
    assert err.value.body["param"] == "tools"
    assert "unclosed group" in err.value.body["message"]
