"""GenerationRequest -> an OpenAI-compatible request body (always streamed).

OpenAI's own fields go as OpenAI names them; vLLM's (and SGLang's, and Switchyard's)
extensions (`top_k`, `min_p`, `min_tokens`, `repetition_penalty`, `structured_outputs`...) are
sent only when asked for, since OpenAI itself refuses fields it does not know. What the wire
cannot carry (tool calls, prompt logprobs) is refused with a 400 before anything is sent.
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import GenerationRequest, RequestError, SamplingParams, StructuredOutput


def _sampling_fields(s: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": s.temperature}
    optional = {
        "max_tokens": s.max_tokens, "seed": s.seed,
        "n": s.n if s.n != 1 else None,
        "top_p": s.top_p if s.top_p != 1.0 else None,
        "stop": list(s.stop) or None,
        "frequency_penalty": s.frequency_penalty or None,
        "presence_penalty": s.presence_penalty or None,
        "logit_bias": {str(token): bias for token, bias in s.logit_bias} or None,
        "top_k": s.top_k or None,
        "min_p": s.min_p or None,
        "min_tokens": s.min_tokens or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "ignore_eos": s.ignore_eos or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def _structured_fields(spec: StructuredOutput | None) -> dict[str, Any]:
    """OpenAI's `response_format` for JSON; vLLM's `structured_outputs` for regex / grammar."""
    if spec is None:
        return {}
    if spec.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except ValueError:
            raise RequestError("the JSON schema is not valid JSON", param=spec.source) from None
        # The client's own name and strict flag; a schema from elsewhere (a forced tool call,
        # vLLM's guided_json) is sent strict, as it was compiled here.
        strict = True if spec.strict is None else spec.strict
        return {"response_format": {"type": "json_schema", "json_schema": {
            "name": spec.name or "response", "schema": schema, "strict": strict}}}
    return {"structured_outputs": {"regex" if spec.kind == "regex" else "grammar": spec.spec}}


def _refuse_unsupported(req: GenerationRequest) -> None:
    if req.tools:
        # The gateway parses calls from the model's text; an upstream answers structured
        # `tool_calls`, which the Backend contract cannot carry.
        raise RequestError("tool calls through remote deployments are not supported yet",
                           param="tools", code="unsupported_parameter")
    if req.sampling.prompt_logprobs is not None:
        raise RequestError(
            "prompt logprobs (`prompt_logprobs`, TGI's `decoder_input_details`) are not "
            "supported through remote (OpenAI-compatible) deployments",
            param="prompt_logprobs", code="unsupported_parameter")


def build_payload(
    req: GenerationRequest, model: str, *, include_usage: bool,
) -> tuple[str, dict[str, Any]]:
    """The path (relative to the base URL) and JSON body for `req`."""
    _refuse_unsupported(req)
    s = req.sampling
    body: dict[str, Any] = {"model": model, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(_sampling_fields(s))
    body.update(_structured_fields(s.structured))
    if req.messages is not None:
        body["messages"] = req.messages
        if not req.add_generation_prompt:
            body["add_generation_prompt"] = False
        if req.chat_template_kwargs:
            body["chat_template_kwargs"] = req.chat_template_kwargs
        if s.logprobs:
            body["logprobs"] = True
            if s.top_logprobs:
                body["top_logprobs"] = s.top_logprobs
        return "/chat/completions", body
    ids = req.prompt_token_ids
    body["prompt"] = list(ids) if ids is not None else (req.prompt or "")
    if s.logprobs:
        body["logprobs"] = s.top_logprobs  # alternatives per token; 0: the chosen one only
    return "/completions", body
