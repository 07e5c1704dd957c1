"""TGI's API on the real engine, driven by Hugging Face's `text-generation` client."""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from text_generation import Client
from text_generation.errors import OverloadedError, ValidationError
from text_generation.types import Grammar, GrammarType, Token

from backends.base import GenerationRequest, SamplingParams, StructuredOutput
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from gateway.tgi.requests import parse_request, plan
from tests.gateway.conftest import running_server

MODEL = "tiny-tgi"
PROMPT = "Once upon a time, in a land far away,"
MAX_TOTAL = 256
MAX_CONCURRENT = 2


@pytest.fixture(scope="module")
def native_backend(tiny_model: Callable[[str], Path]) -> NativeBackend:
    config = EngineConfig(
        model=str(tiny_model("llama_gqa")), served_model_name=MODEL, dtype="float32",
        max_total_tokens=MAX_TOTAL, max_batch_total_tokens=2048, block_size=8,
        max_concurrent_requests=MAX_CONCURRENT, compile=False,
    )
    return NativeBackend(config)


@pytest.fixture(scope="module")
def base_url(native_backend: NativeBackend) -> Iterator[str]:
    app = create_app(Settings(model_id="unused"), backends={MODEL: native_backend})
    with running_server(app, timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def tgi(base_url: str) -> Client:
    return Client(base_url, timeout=30)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as session:
        yield session


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from a /metrics page (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^{re.escape(name)}(?:\{{{re.escape(wanted)}\}})? (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def test_generate_with_details(tgi: Client) -> None:
    out = tgi.generate(PROMPT, max_new_tokens=8)
    details = out.details
    assert details.finish_reason.value in ("length", "eos_token")
    assert details.generated_tokens == len(details.tokens) <= 8
    assert details.seed is None  # greedy
    assert details.prefill == []
    assert all(t.logprob is not None and t.logprob <= 0 for t in details.tokens)
    assert out.generated_text == "".join(t.text for t in details.tokens)


def test_greedy_generate_equals_openai_completions_and_the_stream(
    tgi: Client, base_url: str,
) -> None:
    out = tgi.generate(PROMPT, max_new_tokens=12)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                           temperature=0)
    assert out.generated_text == completion.choices[0].text
    assert out.details.generated_tokens == completion.usage.completion_tokens
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=12))
    assert all(e.generated_text is None and e.details is None for e in events[:-1])
    assert events[-1].generated_text == out.generated_text
    assert "".join(e.token.text for e in events if not e.token.special) == out.generated_text
    assert [e.token.id for e in events] == [t.id for t in out.details.tokens]
    assert all(e.token.logprob is not None for e in events)
    assert events[-1].details.generated_tokens == len(events)
    assert events[-1].details.finish_reason == out.details.finish_reason


def test_sampling_reports_its_seed_and_reproduces(tgi: Client) -> None:
    first = tgi.generate(PROMPT, do_sample=True, seed=7, max_new_tokens=10)
    again = tgi.generate(PROMPT, do_sample=True, seed=7, max_new_tokens=10)
    assert first.details.seed == 7 and first.generated_text == again.generated_text
    implied = tgi.generate(PROMPT, temperature=0.7, max_new_tokens=4)  # do_sample implied
    assert implied.details.seed is not None
    streamed = list(tgi.generate_stream(PROMPT, do_sample=True, seed=7, max_new_tokens=10))
    assert streamed[-1].generated_text == first.generated_text
    assert streamed[-1].details.seed == 7


def test_stop_sequence_and_full_text(tgi: Client) -> None:
    greedy = tgi.generate(PROMPT, max_new_tokens=10, return_full_text=True)
    assert greedy.generated_text.startswith(PROMPT)
    pieces = [t.text for t in greedy.details.tokens]
    stop = next((p for p in pieces[2:] if p.strip()), None)
    if stop is None:
        pytest.skip("the tiny model produced no usable stop text")
    out = tgi.generate(PROMPT, max_new_tokens=10, stop_sequences=[stop])
    assert out.details.finish_reason.value == "stop_sequence"
    assert stop in out.generated_text  # TGI keeps the stop sequence in generated_text
    assert out.generated_text == "".join(t.text for t in out.details.tokens)


def test_too_long_input_is_a_validation_error(tgi: Client, http: httpx.Client) -> None:
    long_prompt = "hello " * 300
    with pytest.raises(ValidationError, match=r"`inputs` tokens \+ `max_new_tokens` must be "
                                              rf"<= {MAX_TOTAL}\. Given: \d+ `inputs` tokens "
                                              r"and 20 `max_new_tokens`"):
        tgi.generate(long_prompt, max_new_tokens=20)
    with pytest.raises(ValidationError):
        next(iter(tgi.generate_stream(long_prompt, max_new_tokens=20)))
    response = http.post("/generate_stream", json={"inputs": long_prompt})
    assert response.status_code == 422
    assert response.json()["error_type"] == "validation"


@pytest.mark.parametrize(("parameters", "message"), [
    ({"temperature": 0}, "`temperature` must be strictly positive"),
    ({"top_p": 1.0}, "`top_p` must be > 0.0 and < 1.0"),
    ({"top_k": 0}, "`top_k` must be strictly positive"),
    ({"max_new_tokens": 0}, "`max_new_tokens` must be strictly positive"),
    ({"typical_p": 0.5}, "`typical_p` is not supported"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "`stop` supports up to 4 stop sequences. Given: 5"),
    ({"top_n_tokens": 6}, "`top_n_tokens` must be >= 0 and <= 5. Given: 6"),
    ({"top_n_tokens": -1}, "Failed to deserialize the JSON body"),
    ({"max_new_tokens": 1.5}, "Failed to deserialize the JSON body"),
    ({"truncate": 0}, "`truncate` must be strictly positive"),
    ({"grammar": "json"}, "parameters.grammar: invalid type: string \"json\", expected "
                          "adjacently tagged enum GrammarType"),
    ({"grammar": {"type": "xml", "value": "<a/>"}},
     "parameters.grammar: unknown variant `xml`, expected `json` or `regex`"),
    ({"grammar": {"value": "a+"}}, "parameters.grammar: missing field `type`"),
    ({"grammar": {"type": "regex"}}, "parameters.grammar: missing field `value`"),
    ({"grammar": {"type": "regex", "value": 7}},
     "parameters.grammar: invalid type: integer `7`, expected a string"),
    ({"grammar": {"type": "json", "value": [1]}}, "grammar is not supported"),
    ({"grammar": {"type": "json", "value": "{not json"}}, "grammar is not valid: "),
])
def test_parameter_validation(http: httpx.Client, parameters: dict, message: str) -> None:
    for route in ("/generate", "/generate_stream"):
        response = http.post(route, json={"inputs": PROMPT, "parameters": parameters})
        assert response.status_code == 422, (route, response.text)
        body = response.json()
        assert body["error_type"] == "validation" and message in body["error"], body


@pytest.mark.parametrize(("route", "parameters", "message"), [
    ("/generate", {"best_of": 5, "do_sample": True}, "`best_of` must be > 0 and <= 4. Given: 5"),
    ("/generate", {"best_of": 0}, "`best_of` must be > 0 and <= 4. Given: 0"),
    ("/generate", {"best_of": 2}, "you must use sampling when `best_of` is > 1"),
    ("/generate", {"best_of": 2, "do_sample": True, "seed": 3},
     "`seed` must not be set when `best_of` > 1"),
    ("/generate_stream", {"best_of": 2, "do_sample": True},
     "`best_of` != 1 is not supported when streaming tokens"),
    ("/generate_stream", {"decoder_input_details": True},
     "`decoder_input_details` == true is not supported when streaming tokens"),
])
def test_what_one_route_refuses(
    http: httpx.Client, route: str, parameters: dict, message: str,
) -> None:
    response = http.post(route, json={"inputs": PROMPT, "parameters": parameters})
    assert response.status_code == 422, response.text
    assert response.json() == {"error": message, "error_type": "validation"}
    if route == "/generate_stream":  # TGI's compat route refuses the same when it streams
        compat = http.post("/", json={"inputs": PROMPT, "stream": True, "parameters": parameters})
        assert compat.status_code == 422 and compat.json()["error"] == message


def test_empty_inputs_and_bad_json(http: httpx.Client) -> None:
    empty = http.post("/generate", json={"inputs": ""})
    assert empty.status_code == 422 and empty.json()["error"] == "`inputs` cannot be empty"
    broken = http.post("/generate", content=b"{not json", headers={"content-type": "text/json"})
    assert broken.status_code == 422 and broken.json()["error_type"] == "validation"


def test_truncate(http: httpx.Client, native_backend: NativeBackend) -> None:
    long_prompt = "word " * 60
    fits = http.post("/generate", json={
        "inputs": PROMPT, "parameters": {"truncate": 100, "max_new_tokens": 2}})
    assert fits.status_code == 200
    cut = http.post("/generate", json={
        "inputs": long_prompt, "parameters": {"truncate": 10, "max_new_tokens": 2}})
    if hasattr(native_backend, "tokenize"):  # the backend can tokenize: TGI's truncation
        assert cut.status_code == 200 and cut.headers["x-prompt-tokens"] == "10"
    else:
        assert cut.status_code == 422 and "truncate" in cut.json()["error"]


def test_compat_route_and_info(http: httpx.Client, native_backend: NativeBackend) -> None:
    listed = http.post("/", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 3}})
    assert listed.status_code == 200
    assert isinstance(listed.json(), list) and "details" not in listed.json()[0]
    assert listed.json()[0]["generated_text"].startswith(PROMPT)  # TGI's default on `/`
    streamed = http.post("/", json={"inputs": PROMPT, "stream": True,
                                    "parameters": {"max_new_tokens": 2, "details": True}})
    assert streamed.headers["content-type"].startswith("text/event-stream")
    assert '"finish_reason": "length"' in streamed.text
    assert int(listed.headers["x-generated-tokens"]) <= 3
    info = http.get("/info").json()
    assert info["model_id"].endswith("llama_gqa") or info["model_id"]
    assert info["served_model_name"] == MODEL
    assert info["model_dtype"] == "torch.float32"
    assert info["max_total_tokens"] == MAX_TOTAL and info["max_input_tokens"] == MAX_TOTAL - 1
    assert info["max_concurrent_requests"] == MAX_CONCURRENT
    assert info["block_size"] == 8
    assert info["max_batch_total_tokens"] >= 2048 - 8
    assert info["max_best_of"] == 4 and info["max_stop_sequences"] == 4
    assert info["max_top_n_tokens"] == 5
    assert info["router"] == "switchyard" and info["version"]
    unknown = http.get("/info", headers={"x-model": "nope"})
    assert unknown.status_code == 404 and unknown.json()["error_type"] == "not_found"


def _wait_for(http: httpx.Client, check: Callable[[str], bool], timeout_s: float = 5.0) -> str:
    """The /metrics page once `check` holds (request metrics settle when the exchange ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = http.get("/metrics").text
        if check(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.02)


def test_metrics_after_requests(tgi: Client, http: httpx.Client) -> None:
    before = http.get("/metrics").text
    count0 = metric(before, "tgi_request_count", model=MODEL)
    tokens0 = metric(before, "tgi_request_generated_tokens_sum", model=MODEL)
    failed0 = metric(before, "tgi_request_failure", err="validation", model=MODEL)
    one = tgi.generate(PROMPT, max_new_tokens=5)
    two = list(tgi.generate_stream(PROMPT, max_new_tokens=7))
    refused = http.post("/generate", json={"inputs": PROMPT, "parameters": {"top_k": 0}})
    assert refused.status_code == 422
    text = _wait_for(http, lambda t: metric(t, "tgi_request_count", model=MODEL) >= count0 + 3)
    assert metric(text, "tgi_request_count", model=MODEL) == count0 + 3
    assert metric(text, "tgi_request_failure", err="validation", model=MODEL) == failed0 + 1
    generated = one.details.generated_tokens + two[-1].details.generated_tokens
    assert metric(text, "tgi_request_generated_tokens_sum", model=MODEL) == tokens0 + generated
    assert metric(text, "tgi_request_success", model=MODEL) >= 2
    for name in ("tgi_request_duration_count", "tgi_request_queue_duration_count",
                 "tgi_request_inference_duration_count", "tgi_request_input_length_count",
                 "tgi_request_mean_time_per_token_duration_count",
                 "switchyard_time_to_first_token_seconds_count",
                 "switchyard_inter_token_latency_seconds_count"):
        assert metric(text, name, model=MODEL) >= 2, name
    assert metric(text, "tgi_batch_forward_duration_count", method="decode", model=MODEL) > 0
    assert metric(text, "tgi_batch_forward_duration_count", method="prefill", model=MODEL) > 0
    assert metric(text, "switchyard_kv_blocks_total", model=MODEL) > 0
    assert metric(text, "tgi_queue_size", model=MODEL) == 0
    assert metric(text, "switchyard_prefix_cache_queries_total", model=MODEL) > 0
    for name in ("tgi_batch_current_size", "tgi_batch_current_max_tokens", "tgi_batch_next_size",
                 "switchyard_prefix_cache_hits_total", "switchyard_preemptions_total"):
        assert re.search(rf'^{name}{{model="{MODEL}"}} ', text, re.MULTILINE), name
    assert "# TYPE tgi_request_count counter" in text


def test_overloaded_answers_429_at_once(
    base_url: str, tgi: Client, http: httpx.Client, native_backend: NativeBackend,
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOTAL - 20, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=base_url, timeout=30) as holder, \
            holder.stream("POST", "/v1/completions", json=body) as first, \
            holder.stream("POST", "/v1/completions", json=body) as second:
        held = [first.iter_lines(), second.iter_lines()]
        for lines in held:
            assert next(lines).startswith("data: ")  # admitted and generating
        started = time.perf_counter()
        tgi_answer = http.post("/generate", json={"inputs": PROMPT})
        openai_stream = http.post("/v1/completions", json={**body, "max_tokens": 4})
        openai_whole = http.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        with pytest.raises(OverloadedError):
            next(iter(tgi.generate_stream(PROMPT)))
        assert time.perf_counter() - started < 2.0
        assert tgi_answer.status_code == 429 and tgi_answer.headers["retry-after"] == "1"
        assert tgi_answer.json() == {"error": "Model is overloaded", "error_type": "overloaded"}
        for answer in (openai_stream, openai_whole):
            assert answer.status_code == 429 and answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["type"] == "overloaded"
        rest = [[line for line in lines if line] for lines in held]  # the admitted complete
    for lines in rest:
        assert lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines)
    text = _wait_for(http, lambda t: metric(t, "tgi_request_failure", err="overloaded",
                                            model=MODEL) >= 4)
    assert metric(text, "tgi_request_failure", err="overloaded", model=MODEL) == 4


@pytest.mark.parametrize(("parameters", "greedy"), [
    ({}, False),  # no `parameters` at all: TGI's default is do_sample=true
    ({"parameters": {}}, True),
    ({"parameters": {"temperature": 1.0}}, True),  # no warper: still greedy
    ({"parameters": {"temperature": 0.5}}, False),
    ({"parameters": {"top_k": 5}}, False),
    ({"parameters": {"top_p": 0.9}}, False),
    ({"parameters": {"do_sample": True, "repetition_penalty": 1.2}}, False),
])
def test_when_tgi_samples(parameters: dict, greedy: bool) -> None:
    body = parse_request({"inputs": "x", **parameters})
    sampling = plan(body, stream=False).sampling
    assert (sampling.temperature == 0) == greedy
    if greedy:
        assert sampling.top_k == 0 and sampling.top_p == 1.0 and sampling.seed is None


def test_plan_maps_the_new_parameters() -> None:
    def sampling(**parameters: object) -> SamplingParams:
        return plan(parse_request({"inputs": "x", "parameters": parameters}),
                    stream=False).sampling

    top = sampling(top_n_tokens=3)
    assert top.logprobs and top.top_logprobs == 3 and top.prompt_logprobs is None
    assert sampling(decoder_input_details=True).prompt_logprobs == 0
    assert sampling(decoder_input_details=True, top_n_tokens=2).prompt_logprobs == 2
    best = sampling(best_of=3, do_sample=True)
    assert best.n == 3 and best.logprobs and best.temperature == 1.0 and best.seed is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_object = sampling(grammar={"type": "json", "value": schema}).structured
    as_text = sampling(grammar={"type": "json", "value": json.dumps(schema)}).structured
    assert as_object == as_text == StructuredOutput("json_schema", json.dumps(schema),
                                                    source="grammar")
    assert json.loads(as_object.spec) == schema
    regex = sampling(grammar={"type": "regex", "value": "[ab]+"}).structured
    assert regex == StructuredOutput("regex", "[ab]+", source="grammar")
    assert sampling().n == 1 and sampling().structured is None


def _top_logprobs_consistent(token: Token, top: list[Token], k: int) -> None:
    """k distinct alternatives, most likely first; the chosen token is among them when its
    logprob reaches the k-th best (it then ranks in the top k)."""
    assert len(top) == k
    assert len({t.id for t in top}) == k
    logprobs = [t.logprob for t in top]
    assert all(lp is not None and lp <= 0 for lp in logprobs)
    assert logprobs == sorted(logprobs, reverse=True)
    if token.logprob > logprobs[-1] + 1e-6:
        chosen = next(t for t in top if t.id == token.id)
        assert chosen.logprob == pytest.approx(token.logprob, abs=1e-5)
        assert chosen.text == token.text


def test_top_n_tokens_whole_and_streamed(tgi: Client) -> None:
    out = tgi.generate(PROMPT, max_new_tokens=8, top_n_tokens=3)
    tokens, top = out.details.tokens, out.details.top_tokens
    assert top is not None and len(top) == len(tokens) == out.details.generated_tokens
    for token, alternatives in zip(tokens, top, strict=True):
        _top_logprobs_consistent(token, alternatives, 3)
        assert alternatives[0].id == token.id  # greedy: the chosen token is the most likely
    events = list(tgi.generate_stream(PROMPT, max_new_tokens=8, top_n_tokens=3))
    assert [e.token.id for e in events] == [t.id for t in tokens]
    for event, alternatives in zip(events, top, strict=True):
        assert [t.id for t in event.top_tokens] == [t.id for t in alternatives]
        assert [t.logprob for t in event.top_tokens] == pytest.approx(
            [t.logprob for t in alternatives], abs=1e-5)
    sampled = tgi.generate(PROMPT, do_sample=True, seed=11, max_new_tokens=8, top_n_tokens=5)
    for token, alternatives in zip(sampled.details.tokens, sampled.details.top_tokens,
                                   strict=True):
        _top_logprobs_consistent(token, alternatives, 5)
    assert tgi.generate(PROMPT, max_new_tokens=2).details.top_tokens is None  # not asked


def test_decoder_input_details_returns_the_prompt(
    tgi: Client, http: httpx.Client, native_backend: NativeBackend,
) -> None:
    prompt_ids = native_backend.tokenize(GenerationRequest(request_id="t", prompt=PROMPT))
    out = tgi.generate(PROMPT, max_new_tokens=3, decoder_input_details=True)
    prefill = out.details.prefill
    assert [t.id for t in prefill] == prompt_ids
    assert prefill[0].logprob is None
    assert all(t.logprob is not None and t.logprob <= 0 for t in prefill[1:])
    assert PROMPT in "".join(t.text for t in prefill)
    # TGI answers details when decoder_input_details alone is set.
    raw = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "max_new_tokens": 2, "decoder_input_details": True}})
    assert raw.status_code == 200, raw.text
    details = raw.json()["details"]
    assert len(details["prefill"]) == int(raw.headers["x-prompt-tokens"]) == len(prompt_ids)
    assert set(details["prefill"][0]) == {"id", "text", "logprob"}
    assert [t["logprob"] for t in details["prefill"][1:]] == pytest.approx(
        [t.logprob for t in prefill[1:]], abs=1e-5)


def _logprob_sum(tokens: list[Token]) -> float:
    return math.fsum(t.logprob for t in tokens)


def test_best_of_answers_the_most_likely_choice(tgi: Client, http: httpx.Client) -> None:
    out = tgi.generate(PROMPT, do_sample=True, best_of=3, max_new_tokens=8, top_n_tokens=2)
    details = out.details
    others = details.best_of_sequences
    assert others is not None and len(others) == 2
    seeds = [details.seed] + [o.seed for o in others]
    assert None not in seeds and len(set(seeds)) == 3  # each choice sampled with its own seed
    best = _logprob_sum(details.tokens)
    for other in others:
        assert other.generated_text == "".join(t.text for t in other.tokens)
        assert other.generated_tokens == len(other.tokens)
        assert len(other.top_tokens) == len(other.tokens)
        assert other.prefill == []
        assert _logprob_sum(other.tokens) <= best + 1e-6
    assert out.generated_text == "".join(t.text for t in details.tokens)
    # Replaying a losing choice's seed alone reproduces it: the seeds are the ones used.
    replay = tgi.generate(PROMPT, do_sample=True, seed=others[0].seed, max_new_tokens=8)
    assert replay.generated_text == others[0].generated_text
    plain = http.post("/generate", json={"inputs": PROMPT, "parameters": {
        "best_of": 2, "do_sample": True, "max_new_tokens": 4}})
    assert plain.status_code == 200 and set(plain.json()) == {"generated_text"}
    listed = http.post("/", json={"inputs": PROMPT, "parameters": {
        "best_of": 2, "temperature": 0.8, "max_new_tokens": 4, "details": True}})
    assert len(listed.json()[0]["details"]["best_of_sequences"]) == 1


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "admin": {"type": "boolean"},
        "level": {"type": "string", "enum": ["low", "mid", "high"]},
    },
    "required": ["name", "admin", "level"],
    "additionalProperties": False,
}


def test_json_grammar_always_validates(tgi: Client) -> None:
    grammar = Grammar(type=GrammarType.Json, value=PERSON)

    def sample(seed: int) -> str:
        out = tgi.generate(PROMPT, do_sample=True, seed=seed, max_new_tokens=120,
                           grammar=grammar)
        return out.generated_text

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        answers = list(pool.map(sample, range(50)))
    for answer in answers:
        jsonschema.validate(json.loads(answer), PERSON)
    assert len(set(answers)) > 1  # sampled, not one canned answer
    as_text = Grammar(type=GrammarType.Json, value=json.dumps(PERSON))
    streamed = list(tgi.generate_stream(PROMPT, do_sample=True, seed=3, max_new_tokens=120,
                                        grammar=as_text))
    assert streamed[-1].generated_text == sample(3)


def test_regex_grammar(tgi: Client) -> None:
    pattern = r"(cat|dog)-[0-9]{3}"
    grammar = Grammar(type=GrammarType.Regex, value=pattern)
    for seed in range(5):
        out = tgi.generate(PROMPT, do_sample=True, seed=seed, max_new_tokens=20, grammar=grammar)
        assert re.fullmatch(pattern, out.generated_text), out.generated_text
        assert out.details.finish_reason.value == "eos_token"


@pytest.mark.parametrize("grammar", [
    {"type": "regex", "value": "(unclosed"},
    {"type": "json", "value": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}},
])
def test_a_grammar_the_engine_cannot_compile_is_a_validation_error(
    http: httpx.Client, tgi: Client, grammar: dict,
) -> None:
    for route in ("/generate", "/generate_stream"):
        response = http.post(route, json={"inputs": PROMPT, "parameters": {"grammar": grammar}})
        assert response.status_code == 422, response.text
        body = response.json()
        assert body["error_type"] == "validation"
        assert body["error"].startswith("grammar is not valid: "), body
    assert tgi.generate(PROMPT, max_new_tokens=2).generated_text  # the engine still serves
