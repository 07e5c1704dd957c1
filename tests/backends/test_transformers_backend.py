"""The transformers backend on real tiny checkpoints: token ids tied to transformers' own
`generate` and to the native engine; streaming, stops, seeds, cancellation, limits, and a real
uvicorn server built from CLI flags, answering the openai SDK."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import openai
import pytest
import pytest_asyncio
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.base import (
    GenerationEvent,
    GenerationRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
)
from backends.registry import BackendSpec, create_backend
from backends.transformers.backend import TransformersBackend
from backends.transformers.options import TransformersOptions
from gateway.app import create_app
from gateway.cli import build_parser, settings_from_args
from tests.gateway.conftest import running_server
from tests.native.test_parity import make_engine, reference_greedy

ASYNC = pytest.mark.asyncio(loop_scope="module")
MAX_TOTAL = 512
PROMPTS = [[5, 900, 31, 4000, 77], [1, 2000, 3000, 12, 9, 48000, 7, 7, 7], [100]]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(model_path: Path) -> AsyncIterator[TransformersBackend]:
    options = TransformersOptions(dtype="float32", max_total_tokens=MAX_TOTAL)
    started = TransformersBackend(str(model_path), options, served_name="tiny")
    await started.start()
    yield started
    await started.close()


def _request(sampling: SamplingParams = GREEDY, **prompt: object) -> GenerationRequest:
    return GenerationRequest(f"req-{next(_ids)}", sampling, **prompt)  # type: ignore[arg-type]


async def _run(backend: TransformersBackend, req: GenerationRequest) -> list[GenerationEvent]:
    return [event async for event in backend.generate(req)]


def _token_ids(events: list[GenerationEvent]) -> list[int]:
    return [token.id for event in events for token in event.tokens]


def _text(events: list[GenerationEvent]) -> str:
    return "".join(event.text for event in events)


def _hf_generate(model: torch.nn.Module, prompt: list[int], **kwargs: object) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), eos_token_id=None, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt):].tolist()


@ASYNC
async def test_greedy_equals_transformers_generate(backend, model_path) -> None:
    expected = reference_greedy(model_path, PROMPTS, 24)
    for prompt, want in zip(PROMPTS, expected, strict=True):
        events = await _run(backend, _request(prompt_token_ids=prompt))
        assert _token_ids(events) == want
        assert events[-1].finish_reason == "length" and events[-1].stop_reason is None
        assert events[-1].usage.prompt_tokens == len(prompt)
        assert events[-1].usage.completion_tokens == 24


@ASYNC
async def test_greedy_equals_the_native_engine_with_penalties(backend, model_path) -> None:
    engine = make_engine(model_path, compile=False)
    for sampling in (GREEDY, SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, repetition_penalty=1.3,
        frequency_penalty=0.5, presence_penalty=0.4,
    )):
        native = [s.output_token_ids for s in engine.generate(PROMPTS, sampling)]
        ours = [_token_ids(await _run(backend, _request(sampling, prompt_token_ids=p)))
                for p in PROMPTS]
        assert ours == native


@ASYNC
async def test_repetition_penalty_equals_transformers(backend, hf_model) -> None:
    sampling = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5)
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[1]))
    want = _hf_generate(hf_model, PROMPTS[1], max_new_tokens=16, do_sample=False,
                        repetition_penalty=1.5)
    assert _token_ids(events) == want


@ASYNC
async def test_chat_template_is_applied(backend, model_path, hf_model) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompt = list(tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))
    req = _request(SamplingParams(max_tokens=8, temperature=0.0), messages=MESSAGES)
    assert backend.count_tokens(req) == len(prompt)
    assert backend.tokenize(req) == prompt
    events = await _run(backend, req)
    assert events[-1].usage.prompt_tokens == len(prompt)
    assert _token_ids(events) == _hf_generate(hf_model, prompt, max_new_tokens=8, do_sample=False)
    without = _request(messages=MESSAGES, add_generation_prompt=False)
    assert backend.count_tokens(without) < len(prompt)


@ASYNC
async def test_streams_one_event_per_token(backend, model_path) -> None:
    events = await _run(backend, _request(prompt="The quick brown fox"))
    assert [len(e.tokens) for e in events] == [1] * 24
    assert [e.finish_reason for e in events[:-1]] == [None] * 23
    assert all(e.usage is None for e in events[:-1])
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    assert events[-1].usage.prompt_tokens == len(tokenizer("The quick brown fox").input_ids)
    assert _text(events) == tokenizer.decode(_token_ids(events), skip_special_tokens=True)
    assert events[-1].timings.inference_seconds > 0


@ASYNC
async def test_stop_sequence_is_trimmed(backend) -> None:
    full = await _run(backend, _request(prompt_token_ids=PROMPTS[0]))
    text = _text(full)
    start = len("".join(e.text for e in full[:5])) - 2  # spans the 5th/6th token boundary
    stop = text[start:start + 6]
    sampling = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    assert _text(events) == text[: text.index(stop)]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == "stop_sequence"
    assert events[-1].usage.completion_tokens <= 7


@ASYNC
async def test_stop_token_ids_and_length(backend) -> None:
    full = _token_ids(await _run(backend, _request(prompt_token_ids=PROMPTS[2])))
    cut = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    sampling = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(full[cut],))
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[2]))
    assert _token_ids(events) == full[: cut + 1]
    assert (events[-1].finish_reason, events[-1].stop_reason) == ("stop", "eos_token")
    short = await _run(backend, _request(SamplingParams(max_tokens=3, temperature=0.0),
                                         prompt_token_ids=PROMPTS[2]))
    assert _token_ids(short) == full[:3] and short[-1].finish_reason == "length"


@ASYNC
async def test_logprobs_are_the_raw_distribution(backend, hf_model) -> None:
    sampling = SamplingParams(max_tokens=6, temperature=0.0, logprobs=True)
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    ids = torch.tensor([PROMPTS[0]])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                            do_sample=False, eos_token_id=None, pad_token_id=0,
                            output_logits=True, return_dict_in_generate=True)
    chosen = out.sequences[0, len(PROMPTS[0]):].tolist()
    want = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(out.logits, chosen,
                                                                         strict=True)]
    got = [t.logprob for e in events for t in e.tokens]
    assert _token_ids(events) == chosen
    assert got == pytest.approx(want, abs=1e-5)


@ASYNC
async def test_seeded_sampling_equals_transformers_and_repeats(backend, hf_model) -> None:
    sampling = SamplingParams(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, seed=1234)
    first = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    again = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    assert _token_ids(first) == _token_ids(again) and first[-1].seed == 1234
    torch.manual_seed(1234)
    want = _hf_generate(hf_model, PROMPTS[0], max_new_tokens=12, do_sample=True,
                        temperature=0.7, top_k=40, top_p=0.9)
    assert _token_ids(first) == want
    other = SamplingParams(max_tokens=12, temperature=0.7, top_k=40, top_p=0.9, seed=99)
    assert _token_ids(await _run(backend, _request(other, prompt_token_ids=PROMPTS[0]))) != want
    unseeded = await _run(backend, _request(SamplingParams(max_tokens=2), prompt="Hi"))
    assert unseeded[-1].seed is not None


@ASYNC
async def test_cancellation_frees_the_worker(backend) -> None:
    before = backend.generated_tokens
    long = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    stream = backend.generate(_request(long, prompt_token_ids=[5, 6, 7]))
    assert len((await anext(stream)).tokens) == 1
    await stream.aclose()
    events = await asyncio.wait_for(
        _run(backend, _request(SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                               prompt_token_ids=[8, 9])), 30)
    assert events[-1].finish_reason == "length"
    assert backend.generated_tokens - before < 250  # the long one stopped early
    assert backend.stats().running == 0 and backend.stats().queue_size == 0


@ASYNC
async def test_prompt_too_long_fails_before_the_first_event(backend) -> None:
    with pytest.raises(RequestError) as too_long:
        await anext(backend.generate(_request(prompt_token_ids=[5] * MAX_TOTAL)))
    assert too_long.value.code == "context_length_exceeded" and too_long.value.status_code == 400
    with pytest.raises(RequestError) as with_max:
        await anext(backend.generate(_request(
            SamplingParams(max_tokens=100), prompt_token_ids=[5] * 500)))
    assert with_max.value.param == "max_tokens"
    with pytest.raises(RequestError, match="vocabulary"):
        await anext(backend.generate(_request(prompt_token_ids=[10**6])))


@ASYNC
async def test_overloaded_is_429(model_path) -> None:
    options = TransformersOptions(dtype="float32", max_total_tokens=64,
                                  max_concurrent_requests=1)
    small = TransformersBackend(str(model_path), options)
    await small.start()
    try:
        held = small.generate(_request(SamplingParams(max_tokens=40, ignore_eos=True),
                                       prompt_token_ids=[5, 6]))
        await anext(held)
        with pytest.raises(RequestError) as refused:
            await anext(small.generate(_request(prompt_token_ids=[5])))
        assert refused.value.status_code == 429 and refused.value.code == "overloaded"
        await held.aclose()
    finally:
        await small.close()


def test_options_are_validated_by_name(model_path) -> None:
    spec = BackendSpec("m", str(model_path), backend="transformers")
    assert isinstance(create_backend(spec), TransformersBackend)
    for options, named in (({"max_batch_size": 8}, "max_batch_size"),
                           ({"dtype": "int8"}, "int8"), ({"num_threads": 0}, "num_threads")):
        bad = BackendSpec("m", str(model_path), backend="transformers", options=options)
        with pytest.raises(ValueError, match=named):
            create_backend(bad)


@ASYNC
async def test_a_hub_id_is_refused_at_start() -> None:
    hub = TransformersBackend("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match="Hugging Face Hub"):
        await hub.start()
    assert not (await hub.health()).ready


def test_cli_backend_flag_serves_through_uvicorn_and_the_openai_sdk(model_path) -> None:
    args = build_parser().parse_args([
        "serve", "--backend", "transformers", "--model-id", str(model_path),
        "--served-model-name", "tiny", "--dtype", "float32", "--max-total-tokens", "256",
        "--max-batch-size", "8",  # a native-only flag: not passed to this backend
    ])
    settings = settings_from_args(args)
    (spec,) = settings.model_specs()
    assert spec.backend == "transformers"
    assert spec.options == {"dtype": "float32", "max_total_tokens": 256}
    with running_server(create_app(settings), timeout_s=120) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        answer = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0)
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        info = httpx.get(f"{url}/info").json()
    assert (info["backend"], info["max_total_tokens"]) == ("transformers", 256)
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 8
    assert streamed == answer.choices[0].message.content


@pytest.mark.slow  # transformers dequantizes the whole GGUF file at load
@ASYNC
async def test_default_gguf_model_knows_the_capital_of_france() -> None:
    default = TransformersBackend("default", TransformersOptions(max_total_tokens=256))
    await default.start()
    try:
        events = await _run(default, _request(
            SamplingParams(max_tokens=20, temperature=0.0), messages=MESSAGES))
        assert "Paris" in _text(events)
        assert default.info().quantization.startswith("gguf")
    finally:
        await default.close()


def _hf_scores(model: torch.nn.Module, prompt: list[int], steps: int,
               **kwargs: object) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy ids and its raw log_softmax (float32) at each step."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps,
                         do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **kwargs)
    return (out.sequences[0, len(prompt):].tolist(),
            [torch.log_softmax(step[0].float(), -1) for step in out.logits])


@ASYNC
async def test_top_logprobs_are_the_raw_top_k_with_the_chosen_first(backend, hf_model) -> None:
    sampling = SamplingParams(max_tokens=5, temperature=0.0, logprobs=True, top_logprobs=4,
                              ignore_eos=True)
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[1]))
    chosen, steps = _hf_scores(hf_model, PROMPTS[1], 5)
    tokens = [t for e in events for t in e.tokens]
    assert [t.id for t in tokens] == chosen
    for token, logprobs in zip(tokens, steps, strict=True):
        values, ids = logprobs.topk(4)
        assert [a.id for a in token.top_logprobs] == ids.tolist()
        assert [a.logprob for a in token.top_logprobs] == pytest.approx(values.tolist(),
                                                                         abs=1e-5)
        assert token.top_logprobs[0].id == token.id  # greedy: the chosen one is the top one
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob, abs=1e-6)
        assert all(a.text for a in token.top_logprobs)


@ASYNC
async def test_logprobs_stay_raw_under_a_logit_bias(backend, hf_model) -> None:
    """The bias moves the choice to its token; logprobs are of the unbiased distribution."""
    target = 4242
    sampling = SamplingParams(max_tokens=4, temperature=0.0, logprobs=True, ignore_eos=True,
                              logit_bias=((target, 100.0),))
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    assert _token_ids(events) == [target] * 4
    ids = torch.tensor([PROMPTS[0] + [target] * 3])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(PROMPTS[0]) - 1:].float()
    want = torch.log_softmax(logits, -1)[:, target].tolist()
    assert [t.logprob for e in events for t in e.tokens] == pytest.approx(want, abs=1e-5)
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(_request(
            SamplingParams(logit_bias=((10**7, 1.0),)), prompt_token_ids=PROMPTS[0])))
    assert caught.value.param == "logit_bias"


@ASYNC
async def test_min_tokens_masks_the_stop_token_like_transformers(backend, hf_model) -> None:
    greedy = _token_ids(await _run(backend, _request(prompt_token_ids=PROMPTS[2])))
    stop = greedy[0]  # would stop at once
    sampling = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop,),
                              min_tokens=4)
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[2]))
    ids = torch.tensor([PROMPTS[2]])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                            do_sample=False, eos_token_id=stop, pad_token_id=0,
                            min_new_tokens=4)[0, len(PROMPTS[2]):].tolist()
    want = out[:out.index(stop) + 1] if stop in out else out
    got = _token_ids(events)
    assert got == want and len(got) >= 4 and stop not in got[:4]


@ASYNC
async def test_min_p_sampling_equals_transformers(backend, hf_model) -> None:
    sampling = SamplingParams(max_tokens=10, temperature=1.3, min_p=0.05, seed=7,
                              ignore_eos=True)
    events = await _run(backend, _request(sampling, prompt_token_ids=PROMPTS[0]))
    torch.manual_seed(7)
    want = _hf_generate(hf_model, PROMPTS[0], max_new_tokens=10, do_sample=True,
                        temperature=1.3, min_p=0.05, top_k=None, top_p=None)
    assert _token_ids(events) == want


@ASYNC
async def test_n_choices_have_their_own_seeds_and_indexes(backend) -> None:
    sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=100, n=3, ignore_eos=True)
    events = await _run(backend, _request(sampled, prompt_token_ids=PROMPTS[0]))
    by_choice = {i: [e for e in events if e.index == i] for i in range(3)}
    assert [len(v) for v in by_choice.values()] == [8, 8, 8]
    for index, mine in by_choice.items():
        assert mine[-1].finish_reason == "length" and mine[-1].seed == 100 + index
        assert mine[-1].usage.completion_tokens == 8
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=100 + index,
                               ignore_eos=True)
        single = await _run(backend, _request(alone, prompt_token_ids=PROMPTS[0]))
        assert _token_ids(mine) == _token_ids(single)  # choice k is seed + k
    assert len({tuple(_token_ids(v)) for v in by_choice.values()}) == 3
    greedy = SamplingParams(max_tokens=6, temperature=0.0, n=2, ignore_eos=True)
    events = await _run(backend, _request(greedy, prompt_token_ids=PROMPTS[1]))
    first, second = ([t for e in events if e.index == i for t in e.tokens] for i in (0, 1))
    assert [t.id for t in first] == [t.id for t in second] and len(first) == 6


@ASYNC
async def test_closing_an_n_request_midway_cancels_every_choice(backend) -> None:
    before = backend.generated_tokens
    long = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, n=3)
    stream = backend.generate(_request(long, prompt_token_ids=[5, 6, 7]))
    await anext(stream)
    await stream.aclose()
    events = await asyncio.wait_for(
        _run(backend, _request(SamplingParams(max_tokens=2), prompt_token_ids=[8])), 30)
    assert events[-1].finish_reason == "length"
    assert backend.generated_tokens - before < 400


@pytest.mark.parametrize(("sampling", "param"), [
    (SamplingParams(structured=StructuredOutput("json_object")), "response_format"),
    (SamplingParams(prompt_logprobs=2), "prompt_logprobs"),
])
@ASYNC
async def test_what_generate_cannot_do_is_refused_naming_the_backend(
    backend, sampling, param,
) -> None:
    with pytest.raises(RequestError) as caught:
        await anext(backend.generate(_request(sampling, prompt_token_ids=PROMPTS[0])))
    err = caught.value
    assert err.status_code == 400 and err.param == param
    assert "transformers backend" in err.message and "native engine" in err.message


@ASYNC
async def test_detokenize_and_the_chat_template_in_info(backend, model_path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    ids = tokenizer("Hello there, general Kenobi").input_ids
    assert backend.detokenize(ids) == tokenizer.decode(ids)
    with pytest.raises(RequestError) as caught:
        backend.detokenize([len(tokenizer) + 5])
    assert caught.value.param == "tokens"
    assert backend.info().chat_template == tokenizer.chat_template
