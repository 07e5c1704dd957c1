"""Ollama's API on the real engine: a real uvicorn server, the real `ollama` client (keys on,
sent as `Authorization: Bearer`), a tiny random Llama with the default model's chat template."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
TAGGED = f"{MODEL}:latest"
ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(32)
SYSTEM = "You are a terse assistant for the lighthouse keepers' guild."
MESSAGES = [{"role": "user", "content": "Tell me a story about a brave little toaster."}]
GREEDY = {"temperature": 0, "num_predict": 16}


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    config = EngineConfig(
        model=str(model_dir), served_model_name=MODEL, dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=8, compile=False,
    )
    app = create_app(Settings(model_id="unused", admin_key=ADMIN_KEY),
                     backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


def _key(base_url: str, **limits: Any) -> str:
    answer = httpx.post(f"{base_url}/admin/keys", json={"name": "ollama", **limits},
                        headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=10)
    assert answer.status_code == 201, answer.text
    return answer.json()["key"]


def _client(base_url: str, key: str) -> ollama.Client:
    return ollama.Client(host=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


@pytest.fixture(scope="module")
def key(base_url: str) -> str:
    return _key(base_url)


@pytest.fixture(scope="module")
def client(base_url: str, key: str) -> ollama.Client:
    return _client(base_url, key)


@pytest.fixture(scope="module")
def chat(base_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _chat(client: ollama.Client, **extra: Any) -> ollama.ChatResponse:
    ask: dict[str, Any] = {"model": TAGGED, "messages": MESSAGES, "options": GREEDY, **extra}
    return client.chat(**ask)


def test_greedy_answer_equals_the_chat_completion(client, chat) -> None:
    """The same conversation through both APIs: the same tokens, the same counts."""
    answer = _chat(client, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    reference = chat.chat.completions.create(
        model=MODEL, max_tokens=16, temperature=0,
        messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert answer.model == TAGGED and answer.done
    assert answer.message.role == "assistant"
    assert answer.message.content == reference.choices[0].message.content
    assert answer.done_reason == {"length": "length", "stop": "stop"}[
        reference.choices[0].finish_reason]
    assert answer.eval_count == reference.usage.completion_tokens
    assert answer.prompt_eval_count == reference.usage.prompt_tokens
    assert answer.load_duration == 0
    assert answer.total_duration >= answer.prompt_eval_duration + answer.eval_duration > 0
    # The system message reaches the template: without it, another prompt.
    assert _chat(client).prompt_eval_count != answer.prompt_eval_count


def test_the_stream_gives_the_same_answer(client) -> None:
    whole = _chat(client)
    parts = list(_chat(client, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content or "" for p in parts) == whole.message.content
    last = parts[-1]
    assert last.message.content == "" and last.done_reason == whole.done_reason == "length"
    assert (last.eval_count, last.prompt_eval_count) == (whole.eval_count,
                                                         whole.prompt_eval_count)
    assert last.eval_duration > 0 and last.total_duration > 0


def test_streaming_is_ndjson_by_default(base_url: str, key: str) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "options": {"temperature": 0, "num_predict": 4}}
    with httpx.stream("POST", f"{base_url}/api/chat", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"}) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in answer.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4
    assert all(line["done"] is False for line in lines[:-1]) and len(lines) >= 2
    whole = httpx.post(f"{base_url}/api/chat", json={**body, "stream": False}, timeout=60,
                       headers={"Authorization": f"Bearer {key}"})
    assert whole.headers["content-type"] == "application/json"
    assert whole.json()["message"]["content"] == "".join(
        line["message"]["content"] for line in lines)


def test_generate_is_the_prompt_as_a_chat(client, chat) -> None:
    answer = client.generate(model=MODEL, prompt=MESSAGES[0]["content"], system=SYSTEM,
                             options=GREEDY)
    reference = _chat(client, messages=[{"role": "system", "content": SYSTEM}, *MESSAGES])
    assert answer.response == reference.message.content
    assert answer.prompt_eval_count == reference.prompt_eval_count
    streamed = list(client.generate(model=TAGGED, prompt=MESSAGES[0]["content"],
                                    system=SYSTEM, options=GREEDY, stream=True))
    assert "".join(p.response for p in streamed) == answer.response
    assert streamed[-1].done and streamed[-1].done_reason == answer.done_reason


def test_raw_generate_is_the_completion(client, chat) -> None:
    prompt = "Once upon a time, in a lighthouse"
    answer = client.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    reference = chat.completions.create(model=MODEL, prompt=prompt, max_tokens=16,
                                        temperature=0)
    assert answer.response == reference.choices[0].text
    assert answer.prompt_eval_count == reference.usage.prompt_tokens


def test_num_predict_ends_with_length(client) -> None:
    answer = _chat(client, options={"temperature": 0, "num_predict": 5})
    assert (answer.eval_count, answer.done_reason) == (5, "length")
    unbounded = _chat(client, options={"temperature": 0, "num_predict": -1})
    assert unbounded.eval_count > 16  # up to the window (or the end of the answer)


def test_a_stop_string_ends_the_answer(client) -> None:
    whole = _chat(client, options={"temperature": 0, "num_predict": 24}).message.content
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]
    assert stop.strip(), whole
    answer = _chat(client, options={"temperature": 0, "num_predict": 24,
                                    "stop": ["\u2603never", stop]})
    assert answer.message.content == whole[:whole.find(stop)]
    assert answer.done_reason == "stop"


def test_a_seed_makes_sampling_reproducible(client) -> None:
    def sampled(seed: int) -> str:
        options = {"temperature": 1.0, "seed": seed, "num_predict": 16}
        return _chat(client, options=options).message.content

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_every_option_means_its_chat_completion_field(client, chat) -> None:
    options = {"temperature": 0.9, "top_k": 5, "top_p": 0.8, "min_p": 0.05, "seed": 3,
               "repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4,
               "num_predict": 12, "num_ctx": 4096, "num_thread": 2, "mirostat": 0}
    answer = _chat(client, options=options)
    reference = chat.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0.9, top_p=0.8, seed=3, max_tokens=12,
        presence_penalty=0.5, frequency_penalty=0.4,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3})
    assert answer.message.content == reference.choices[0].message.content
    plain = chat.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0.9,
                                         seed=3, max_tokens=12)
    assert plain.choices[0].message.content != answer.message.content  # they all mattered


def test_repeat_penalty_is_the_repetition_penalty(client, chat) -> None:
    options = {"temperature": 0, "num_predict": 24, "repeat_penalty": 3.0}
    answer = _chat(client, options=options).message.content
    reference = chat.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
        extra_body={"repetition_penalty": 3.0}).choices[0].message.content
    assert answer == reference
    assert answer != _chat(client, options={"temperature": 0, "num_predict": 24}).message.content


def test_a_bad_option_is_a_400(client) -> None:
    for options, field in (({"temperature": -1}, "options.temperature"),
                           ({"num_predict": 1.5}, "options.num_predict"),
                           ({"top_p": "high"}, "options.top_p")):
        with pytest.raises(ollama.ResponseError) as bad:
            _chat(client, options=options)
        assert bad.value.status_code == 400 and field in bad.value.error


def test_a_json_schema_format_constrains_the_answer(client) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string",
                                                          "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    answer = _chat(client, format=schema, options={"temperature": 0, "num_predict": 32})
    jsonschema.validate(json.loads(answer.message.content), schema)
    loose = _chat(client, format="json", options={"temperature": 0, "num_predict": 48})
    assert loose.message.content.lstrip().startswith("{")
    unusable = {"type": "string", "pattern": "(unclosed"}
    with pytest.raises(ollama.ResponseError) as uncompiled:  # the engine's own refusal
        _chat(client, format=unusable)
    assert uncompiled.value.status_code == 400
    assert uncompiled.value.error.endswith("(param: format)")


def test_no_messages_or_prompt_only_loads(client) -> None:
    loaded = client.chat(model=TAGGED, messages=[])
    assert (loaded.done, loaded.done_reason, loaded.message.content) == (True, "load", "")
    assert client.generate(model=MODEL, prompt="").done_reason == "load"


def test_list_show_ps_version(client, base_url: str, model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    parameters = AutoModelForCausalLM.from_pretrained(model_dir).num_parameters()
    (listed,) = client.list().models
    assert listed.model == TAGGED and len(listed.digest) == 64 and listed.size > 0
    details = listed.details
    assert (details.format, details.family, details.quantization_level) == (
        "safetensors", "llama", "F32")
    assert details.parameter_size and details.parameter_size[-1] in "KMB"
    shown = client.show(TAGGED)
    assert shown.modelinfo["general.parameter_count"] == parameters
    assert shown.modelinfo["llama.context_length"] == 256
    assert {"completion", "tools"} <= set(shown.capabilities)
    assert "thinking" not in shown.capabilities
    assert "{%" in shown.template and shown.details == details
    (loaded,) = client.ps().models
    assert (loaded.model, loaded.context_length, loaded.size_vram) == (TAGGED, 256, 0)
    assert httpx.get(f"{base_url}/api/version").json()["version"]
    root = httpx.get(base_url)
    assert (root.status_code, root.text) == (200, "Ollama is running")
    assert httpx.head(base_url).status_code == 200


def test_refusals_are_ollama_errors(client) -> None:
    with pytest.raises(ollama.ResponseError) as unknown:
        client.chat(model="llama3.2:latest", messages=MESSAGES)
    assert unknown.value.status_code == 404 and "not served" in unknown.value.error
    with pytest.raises(ollama.ResponseError) as unknown_show:
        client.show("llama3.2")
    assert unknown_show.value.status_code == 404
    image = {"role": "user", "content": "What is this?", "images": ["iVBORw0KGgo="]}
    with pytest.raises(ollama.ResponseError) as vision:
        client.chat(model=MODEL, messages=[image])
    assert vision.value.status_code == 400 and "vision model" in vision.value.error
    with pytest.raises(ollama.ResponseError) as fim:
        client.generate(model=MODEL, prompt="def f(", suffix="return 1")
    assert fim.value.status_code == 400 and "suffix" in fim.value.error
    with pytest.raises(ollama.ResponseError) as embed:
        client.embed(model=TAGGED, input="hello")
    assert embed.value.status_code == 400 and "not an embedding model" in embed.value.error


def test_a_bad_key_is_a_401(base_url: str) -> None:
    stranger = _client(base_url, "sk-sy-" + "0" * 43)
    for call in (lambda: _chat(stranger), stranger.list, lambda: stranger.show(MODEL),
                 lambda: list(_chat(stranger, stream=True))):
        with pytest.raises(ollama.ResponseError) as denied:
            call()
        assert denied.value.status_code == 401 and isinstance(denied.value.error, str)


def test_a_rate_limited_key_is_a_429(base_url: str) -> None:
    key = _key(base_url, rpm=1)
    limited = _client(base_url, key)
    _chat(limited, options={"num_predict": 2})
    with pytest.raises(ollama.ResponseError) as refused:
        _chat(limited, options={"num_predict": 2})
    assert refused.value.status_code == 429 and isinstance(refused.value.error, str)
    with pytest.raises(ollama.ResponseError) as stream_refused:  # before the stream starts
        list(_chat(limited, stream=True))
    assert stream_refused.value.status_code == 429
    answer = httpx.post(f"{base_url}/api/generate", json={"model": MODEL, "prompt": "hi"},
                        headers={"Authorization": f"Bearer {key}"}, timeout=10)
    assert answer.status_code == 429 and int(answer.headers["retry-after"]) >= 1
    assert set(answer.json()) == {"error"}


def _counter(base_url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               for s in family.samples
               if s.name in (name, f"{name}_total") and s.labels == labels)


def test_usage_and_metrics_count_these_requests(base_url: str) -> None:
    key = _key(base_url)
    client = _client(base_url, key)
    route = {"route": "/api/chat", "model": MODEL, "status": "200"}
    requests, successes = (_counter(base_url, "switchyard_requests", **route),
                           _counter(base_url, "tgi_request_success", model=MODEL))
    whole = _chat(client)
    streamed = list(_chat(client, stream=True))[-1]
    generated = client.generate(model=MODEL, prompt="Hello", options=GREEDY)
    usage = httpx.get(f"{base_url}/v1/usage", headers={"Authorization": f"Bearer {key}"},
                      timeout=10).json()
    (row,) = usage["data"]
    answers = (whole, streamed, generated)
    assert row["requests"] == 3
    assert row["prompt_tokens"] == sum(a.prompt_eval_count for a in answers)
    assert row["completion_tokens"] == sum(a.eval_count for a in answers)
    deadline = time.monotonic() + 5  # outcomes are recorded once each exchange has ended
    while _counter(base_url, "tgi_request_success", model=MODEL) < successes + 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert _counter(base_url, "switchyard_requests", **route) == requests + 2
