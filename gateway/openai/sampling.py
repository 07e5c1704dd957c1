"""Validated request bodies -> the backend's `GenerationRequest`."""

from __future__ import annotations

import uuid

from backends.base import GenerationRequest, SamplingParams
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest, SamplingFields


def new_request_id() -> str:
    return uuid.uuid4().hex


def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(body.top_k or 0, 0),
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        repetition_penalty=body.repetition_penalty or 1.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
    )


def chat_request(body: ChatCompletionRequest, request_id: str) -> GenerationRequest:
    return GenerationRequest(
        request_id=request_id,
        sampling=sampling_params(body, body.token_limit(), bool(body.logprobs)),
        messages=[m.as_dict() for m in body.messages],
        add_generation_prompt=body.add_generation_prompt,
    )


def completion_request(body: CompletionRequest, request_id: str) -> GenerationRequest:
    sampling = sampling_params(body, body.token_limit(), body.logprobs is not None)
    if isinstance(body.prompt, str):
        return GenerationRequest(request_id=request_id, sampling=sampling, prompt=body.prompt)
    # Pre-tokenized: `prompt_token_ids` overrides the (empty) text prompt.
    return GenerationRequest(
        request_id=request_id, sampling=sampling, prompt="", prompt_token_ids=list(body.prompt),
    )
