"""GenerationRequest -> an OpenAI-compatible request body (always streamed)."""

from __future__ import annotations

from typing import Any

from backends.base import GenerationRequest, SamplingParams


def _sampling_fields(s: SamplingParams) -> dict[str, Any]:
    body: dict[str, Any] = {"temperature": s.temperature}
    optional = {
        "max_tokens": s.max_tokens, "seed": s.seed,
        "top_p": s.top_p if s.top_p != 1.0 else None,
        "stop": list(s.stop) or None,
        "frequency_penalty": s.frequency_penalty or None,
        "presence_penalty": s.presence_penalty or None,
        # vLLM's (and Switchyard's) extensions: sent only when asked for, since OpenAI
        # itself refuses fields it does not know.
        "top_k": s.top_k or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "stop_token_ids": list(s.stop_token_ids) or None,
        "ignore_eos": s.ignore_eos or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    return body


def build_payload(
    req: GenerationRequest, model: str, *, include_usage: bool,
) -> tuple[str, dict[str, Any]]:
    """The path (relative to the base URL) and JSON body for `req`."""
    body: dict[str, Any] = {"model": model, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    body.update(_sampling_fields(req.sampling))
    if req.messages is not None:
        body["messages"] = req.messages
        if not req.add_generation_prompt:
            body["add_generation_prompt"] = False
        if req.sampling.logprobs:
            body["logprobs"] = True
        return "/chat/completions", body
    ids = req.prompt_token_ids
    body["prompt"] = list(ids) if ids is not None else (req.prompt or "")
    if req.sampling.logprobs:
        body["logprobs"] = 0  # the chosen token's logprob, no alternatives
    return "/completions", body
