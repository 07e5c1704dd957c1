"""Validated request bodies -> the backend's `GenerationRequest` (and the chat's tool plan)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from backends.base import (
    NO_SAMPLING_DEFAULTS,
    GenerationRequest,
    SamplingDefaults,
    SamplingParams,
    StructuredOutput,
)
from gateway.errors import OpenAIError, bad_request
from gateway.openai.requests import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.openai.tools import ToolPlan, ToolSpecError, plan_tools


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Asked:
    """What a body asks beyond the shared fields."""

    max_tokens: int | None
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    structured: StructuredOutput | None = None


def _pick(asked: float | None, default: float | None, neutral: float) -> float:
    if asked is not None:
        return asked
    return neutral if default is None else default


def sampling_params(body: SamplingFields, asked: Asked,
                    defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> SamplingParams:
    """The body's sampling; what it omits comes from the model's `defaults`, else neutral."""
    return SamplingParams(
        max_tokens=asked.max_tokens,
        temperature=_pick(body.temperature, defaults.temperature, 1.0),
        top_p=_pick(body.top_p, defaults.top_p, 1.0),
        top_k=max(int(_pick(body.top_k, defaults.top_k, 0)), 0),
        min_p=_pick(body.min_p, defaults.min_p, 0.0),
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        logprobs=asked.logprobs,
        top_logprobs=asked.top_logprobs,
        repetition_penalty=_pick(body.repetition_penalty, defaults.repetition_penalty, 1.0),
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        n=asked.n,
        logit_bias=body.logit_bias,
        min_tokens=body.min_tokens or 0,
        structured=asked.structured,
    )


def uses_tools(body: ChatCompletionRequest) -> bool:
    return bool(body.tools) or any(m.tool_calls or m.role == "tool" for m in body.messages)


def tool_plan(body: ChatCompletionRequest, chat_template: str | None,
              parser_override: str | None = None) -> ToolPlan | None:
    """The plan for the request's tools (and tool history); None when it has neither."""
    if not uses_tools(body):
        return None
    try:
        return plan_tools(body.tools or [], body.tool_choice, body.parallel_tool_calls is not False,
                          chat_template, parser_override)
    except ToolSpecError as exc:
        raise _tool_error(exc) from None


def _tool_error(exc: ToolSpecError) -> OpenAIError:
    return bad_request(exc.message, exc.param or "tools", "invalid_value")


def chat_request(body: ChatCompletionRequest, request_id: str, plan: ToolPlan | None = None,
                 defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> GenerationRequest:
    messages: list[dict[str, Any]] = [m.as_dict() for m in body.messages]
    structured = body.structured()
    tools = None
    if plan is not None:
        try:
            messages = plan.template_messages(messages)
        except ToolSpecError as exc:
            raise _tool_error(exc) from None
        tools = plan.tools
        structured = plan.structured or structured  # check() refused having both
    asked = Asked(body.token_limit(), body.choices(), bool(body.logprobs),
                  body.top_logprobs_count(), structured)
    return GenerationRequest(
        request_id=request_id, sampling=sampling_params(body, asked, defaults), messages=messages,
        add_generation_prompt=body.add_generation_prompt, tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def completion_request(body: CompletionRequest, request_id: str,
                       defaults: SamplingDefaults = NO_SAMPLING_DEFAULTS) -> GenerationRequest:
    # best_of ranks its candidates by their tokens' logprobs, asked or not.
    logprobs = body.logprobs is not None or body.candidates() > body.choices()
    asked = Asked(body.token_limit(), body.candidates(), logprobs, body.logprobs or 0,
                  body.structured())
    sampling = sampling_params(body, asked, defaults)
    if isinstance(body.prompt, str):
        return GenerationRequest(request_id=request_id, sampling=sampling, prompt=body.prompt)
    # Pre-tokenized: `prompt_token_ids` overrides the (empty) text prompt.
    return GenerationRequest(
        request_id=request_id, sampling=sampling, prompt="", prompt_token_ids=list(body.prompt),
    )
