"""Engine features of the OpenAI surface: top logprobs and prompt logprobs against
transformers' float32 log_softmax, structured outputs on a random-weight model, and the
backend's validation, detokenize and n-choice streams."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from backends.base import (
    GenerationEvent,
    GenerationRequest,
    RequestError,
    SamplingParams,
    StructuredOutput,
)
from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from backends.native.llm_engine import LLMEngine, RequestOutput
from tests.native.test_parity import assert_all_blocks_free, make_engine

TOLERANCE = 1e-4


def _prompt(length: int, seed: int = 11) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 49152, (length,), generator=gen).tolist()


@pytest.fixture(scope="module")
def path(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def reference(path: Path) -> Callable[[list[int]], torch.Tensor]:
    """Float32 log_softmax of transformers' logits at every position of `ids`."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[tuple[str, int], list[RequestOutput]] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault((out.request_id, out.index), []).append(out)
        engine.block_manager.check_integrity()
    return outputs


def _assert_top(top, row: torch.Tensor, k: int) -> None:
    values, ids = row.topk(k)
    assert [t.id for t in top] == ids.tolist()
    for alt, value in zip(top, values.tolist(), strict=True):
        assert abs(alt.logprob - value) < TOLERANCE


def test_top_logprobs_match_transformers(path: Path, reference, tokenizer_dir: Path) -> None:
    prompt = _prompt(19)
    params = {
        "greedy": SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=True,
                                 top_logprobs=5),
        # logprobs stay those of the raw distribution whatever temperature and penalties do
        "sampled": SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True,
                                  logprobs=True, top_logprobs=3, repetition_penalty=1.5),
    }
    engine = make_engine(path, block_size=8)
    outputs = _run(engine, {rid: (prompt, p) for rid, p in params.items()})
    for rid, p in params.items():
        tokens = [t for out in outputs[(rid, 0)] for t in out.tokens]
        ids = [t.id for t in tokens]
        rows = reference(prompt + ids)[len(prompt) - 1 : -1]
        for token, row in zip(tokens, rows, strict=True):
            assert abs(token.logprob - row[token.id].item()) < TOLERANCE
            _assert_top(token.top_logprobs, row, p.top_logprobs)
            if p.is_greedy:
                assert token.top_logprobs[0].id == token.id
        alt = tokens[0].top_logprobs[1]
        assert alt.text == engine.tokenizer.decode([alt.id], skip_special_tokens=False)
    assert_all_blocks_free(engine)


def test_no_logprobs_unless_asked(path: Path) -> None:
    engine = make_engine(path, block_size=8)
    plain = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, top_logprobs=0)
    outputs = _run(engine, {"r": (_prompt(5), plain)})
    tokens = [t for out in outputs[("r", 0)] for t in out.tokens]
    assert all(t.logprob is None and t.top_logprobs == () for t in tokens)
    assert all(out.prompt_token_infos is None for out in outputs[("r", 0)])


@pytest.mark.parametrize("chunk", [7, 4096])
def test_prompt_logprobs_match_transformers(path: Path, reference, chunk: int) -> None:
    """Chunked or whole prefill, with the prompt's blocks already in the prefix cache (the
    request must skip it: every prompt position's logits are needed)."""
    prompt = _prompt(37, seed=5)
    engine = make_engine(path, block_size=4, max_batch_prefill_tokens=chunk)
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    _run(engine, {"warm": (prompt, greedy)})
    asked = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3,
                           n=2)
    outputs = _run(engine, {"r": (prompt, asked)})
    first, *rest = outputs[("r", 0)]
    infos = first.prompt_token_infos
    assert [t.id for t in infos] == prompt
    assert infos[0].logprob is None
    rows = reference(prompt)
    for j in range(1, len(prompt)):
        assert abs(infos[j].logprob - rows[j - 1, prompt[j]].item()) < TOLERANCE
        _assert_top(infos[j].top_logprobs, rows[j - 1], 3)
    assert all(out.prompt_token_infos is None for out in rest + outputs[("r", 1)])
    assert_all_blocks_free(engine)


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "mood": {"enum": ["happy", "sad"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "mood", "ok"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("kv_tokens", [4096, 256])
def test_json_schema_output_always_validates(path: Path, kv_tokens: int) -> None:
    """A random-weight model at temperature 1 only ever writes what the grammar allows; the
    grammar state survives preemption (a tight KV budget recomputes sequences)."""
    engine = make_engine(path, block_size=8, max_total_tokens=128,
                         max_batch_total_tokens=kv_tokens)
    grammar = engine.grammars.compile(StructuredOutput("json_schema", json.dumps(PERSON)))
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=0, n=10)
    engine.add_request("a", _prompt(9), params, grammar)
    engine.add_request("b", _prompt(4, seed=2), params, grammar)
    texts: dict[tuple[str, int], str] = {}
    reasons = []
    while engine.has_work():
        for out in engine.step():
            key = (out.request_id, out.index)
            texts[key] = texts.get(key, "") + out.text
            if out.finished:
                reasons.append(out.finish_reason)
    assert len(texts) == 20 and reasons == ["stop"] * 20
    for text in texts.values():
        jsonschema.validate(json.loads(text), PERSON)
    assert (engine.scheduler.num_preemptions > 0) == (kv_tokens < 1024)
    assert_all_blocks_free(engine)


# -- the backend -------------------------------------------------------------------------------

async def _collect(backend: NativeBackend, req: GenerationRequest) -> list[GenerationEvent]:
    return [event async for event in backend.generate(req)]


async def _refusal(backend: NativeBackend, sampling: SamplingParams) -> RequestError:
    with pytest.raises(RequestError) as err:
        await _collect(backend, GenerationRequest("bad", sampling, prompt="Hello"))
    return err.value


def test_backend_choices_validation_and_detokenize(path: Path) -> None:
    async def main() -> None:
        backend = NativeBackend(EngineConfig(
            model=str(path), dtype="float32", max_total_tokens=256,
            max_batch_total_tokens=2048, block_size=8,
        ))
        await backend.start()
        try:
            await _checks(backend)
        finally:
            await backend.close()

    asyncio.run(main())


async def _checks(backend: NativeBackend) -> None:
    engine = backend.engine
    assert engine is not None
    assert backend.info().chat_template == engine.tokenizer.chat_template is not None

    sampling = SamplingParams(max_tokens=5, temperature=1.0, seed=4, n=3, ignore_eos=True)
    events = await _collect(backend, GenerationRequest("n3", sampling, prompt="Once upon"))
    finals = [e for e in events if e.finish_reason is not None]
    assert sorted(e.index for e in finals) == [0, 1, 2]
    assert all(e.usage.completion_tokens == 5 and e.seed == 4 + e.index for e in finals)
    assert events[-1].finish_reason is not None

    vocab = engine.tokenizer.vocab_size
    bad_bias = SamplingParams(logit_bias=((vocab + 5, 1.0),))
    assert (await _refusal(backend, bad_bias)).param == "logit_bias"
    assert (await _refusal(backend, SamplingParams(stop_token_ids=(-1,)))).param == (
        "stop_token_ids")
    assert (await _refusal(backend, SamplingParams(max_tokens=2, min_tokens=3))).param == (
        "min_tokens")
    broken = SamplingParams(structured=StructuredOutput("json_schema", '{"type": "nope"}'))
    assert (await _refusal(backend, broken)).param == "response_format"
    tgi_grammar = SamplingParams(structured=StructuredOutput("regex", "(", source="grammar"))
    assert (await _refusal(backend, tgi_grammar)).param == "grammar"

    ids = engine.tokenizer.encode("Hello there, world")
    assert backend.detokenize(ids) == engine.tokenizer.decode(ids, skip_special_tokens=False)
    with pytest.raises(RequestError) as err:
        backend.detokenize([vocab])
    assert err.value.param == "tokens"
    assert_all_blocks_free(engine)


# -- issue-11 review fixes -------------------------------------------------------------------

class _Watched(torch.Tensor):
    """Records the largest tensor any torch operation on it produced, in bytes."""

    largest = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, torch.Tensor):
            _Watched.largest = max(_Watched.largest, out.numel() * out.element_size())
        return out


def test_prompt_logprobs_of_a_long_prompt_are_computed_in_slices(tokenizer_dir: Path) -> None:
    """A [P, V] float32 copy of a long prompt's logits takes gigabytes: the work goes in
    slices of PROMPT_ROWS_PER_SLICE rows, with the same values as in one piece."""
    from backends.native.sampling import logprobs
    from backends.text.token_texts import TokenTexts
    from backends.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))
    rows, vocab = 3 * logprobs.PROMPT_ROWS_PER_SLICE + 5, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator()).tolist()
    texts = TokenTexts(tokenizer)
    _Watched.largest = 0
    infos = logprobs.prompt_token_infos(
        logits.to(torch.bfloat16).as_subclass(_Watched), targets, 2, texts, lambda t: False)
    assert 0 < _Watched.largest <= logprobs.PROMPT_ROWS_PER_SLICE * vocab * 4
    reference = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    assert [t.id for t in infos] == targets
    for j, info in enumerate(infos):
        assert abs(info.logprob - reference[j, targets[j]].item()) < TOLERANCE
        _assert_top(info.top_logprobs, reference[j], 2)


def test_the_chosen_token_reads_the_same_among_its_alternatives(path: Path) -> None:
    """A token that ends mid-character has no text yet (the detokenizer holds it back): its
    own entry among the alternatives says the same, while the others keep their texts."""
    engine = make_engine(path, block_size=8)
    ids = engine.tokenizer.encode("🙂🙂")
    texts = engine.choice_outputs.token_texts
    partial = next(t for t in ids if texts(t).endswith("\ufffd"))
    other = next(t for t in range(300, 400) if texts(t).isalpha())
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=True,
                            top_logprobs=2)
    seq = engine.add_request("r", _prompt(6), params)
    engine.step()
    out = engine._append(seq, partial, -0.5, [(partial, -0.5), (other, -1.0)])
    (info,) = out.tokens
    assert info.id == partial and info.text == out.text == ""
    assert [(a.id, a.text) for a in info.top_logprobs] == [
        (partial, info.text), (other, texts(other))]


def test_decode_checked_refuses_ids_outside_the_vocabulary(tokenizer_dir: Path) -> None:
    from backends.text.prompt_checks import decode_checked
    from backends.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir))
    ids = tokenizer.encode("Hello there")
    assert decode_checked(tokenizer, ids) == "Hello there"
    for bad in ([tokenizer.vocab_size], [-1]):
        with pytest.raises(RequestError) as err:
            decode_checked(tokenizer, ids + bad)
        assert err.value.param == "tokens" and str(tokenizer.vocab_size - 1) in str(err.value)


def test_the_engine_thread_survives_an_unexpected_failure(path: Path) -> None:
    """A failure outside the step's own guard fails the requests in flight with "error"
    instead of killing the engine thread (which would leave every stream waiting)."""

    async def main() -> None:
        backend = NativeBackend(EngineConfig(
            model=str(path), dtype="float32", max_total_tokens=256,
            max_batch_total_tokens=2048, block_size=8,
        ))
        await backend.start()
        engine = backend.engine
        assert engine is not None
        schedule = engine.scheduler.schedule

        def fail_once():
            engine.scheduler.schedule = schedule
            raise RuntimeError("scheduler bug")

        engine.scheduler.schedule = fail_once
        try:
            sampling = SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2,
                                      ignore_eos=True)
            req = GenerationRequest("victim", sampling, prompt="Hello")
            events = await asyncio.wait_for(_collect(backend, req), 30)
            assert sorted((e.index, e.finish_reason) for e in events) == [
                (0, "error"), (1, "error")]
            again = GenerationRequest("after", SamplingParams(max_tokens=3, ignore_eos=True),
                                      prompt="Hello")
            events = await asyncio.wait_for(_collect(backend, again), 30)
            assert events[-1].finish_reason == "length" and events[-1].usage.completion_tokens == 3
            assert_all_blocks_free(engine)
        finally:
            await backend.close()

    asyncio.run(main())
