"""A request's prompt as token ids, and the checks every in-process backend runs on it.

Shared by the native engine and the transformers backend, so both refuse the same requests
with the same messages.
"""

from __future__ import annotations

from collections.abc import Sequence

from backends.base import GenerationRequest, RequestError, SamplingParams
from backends.text.tokenizer import ChatTemplateError, Tokenizer


def encode_request(tokenizer: Tokenizer, req: GenerationRequest) -> list[int]:
    """The prompt's token ids: given ids, the chat template over messages, or the text."""
    if req.prompt_token_ids is not None:
        return list(req.prompt_token_ids)
    if req.messages is not None:
        try:
            return tokenizer.encode_chat(req.messages, req.add_generation_prompt, req.tools,
                                         req.chat_template_kwargs)
        except ChatTemplateError as e:
            raise RequestError(str(e), param=e.param) from None
    return tokenizer.encode(req.prompt or "")


def check_prompt(
    ids: Sequence[int], sampling: SamplingParams, field: str, *, vocab_size: int,
    max_input_tokens: int, max_total_tokens: int,
) -> None:
    """RequestError (400) for an empty prompt, ids outside the vocabulary (prompt, logit_bias,
    stop_token_ids), min_tokens above max_tokens, or a prompt (plus max_tokens) beyond the
    model's limits."""
    n = len(ids)
    if n == 0:
        raise RequestError("the prompt is empty", param=field)
    if any(not 0 <= t < vocab_size for t in ids):
        raise RequestError("prompt token ids must be within the vocabulary", param=field)
    check_token_ids(sampling, vocab_size)
    if n > max_input_tokens:
        raise RequestError(
            f"the prompt has {n} tokens, more than this model's maximum input of "
            f"{max_input_tokens} tokens",
            param=field, code="context_length_exceeded",
        )
    wanted = sampling.max_tokens or 1
    if n + wanted > max_total_tokens:
        raise RequestError(
            f"this model's maximum context length is {max_total_tokens} tokens; "
            f"your prompt has {n} tokens and max_tokens is {wanted}: reduce one of them",
            param="max_tokens", code="context_length_exceeded",
        )


def check_token_ids(sampling: SamplingParams, vocab_size: int) -> None:
    """The sampling parameters that name token ids name ones the model has."""
    if any(not 0 <= t < vocab_size for t, _ in sampling.logit_bias):
        raise RequestError(
            f"logit_bias token ids must be within the vocabulary (0 to {vocab_size - 1})",
            param="logit_bias",
        )
    if any(not 0 <= t < vocab_size for t in sampling.stop_token_ids):
        raise RequestError(
            f"stop_token_ids must be within the vocabulary (0 to {vocab_size - 1})",
            param="stop_token_ids",
        )
    if sampling.max_tokens is not None and sampling.min_tokens > sampling.max_tokens:
        raise RequestError(
            f"min_tokens ({sampling.min_tokens}) must not exceed max_tokens "
            f"({sampling.max_tokens})",
            param="min_tokens",
        )


def decode_checked(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of `token_ids` (special tokens kept); RequestError for an id outside the
    vocabulary."""
    if any(not 0 <= t < tokenizer.vocab_size for t in token_ids):
        raise RequestError(
            f"token ids must be within the vocabulary (0 to {tokenizer.vocab_size - 1})",
            param="tokens",
        )
    return tokenizer.decode(list(token_ids), skip_special_tokens=False)


def overloaded(limit: int, setting: str) -> RequestError:
    """The 429 for a backend with `limit` requests in flight already."""
    return RequestError(
        f"the model is overloaded: {limit} requests are in flight ({setting}); retry shortly",
        code="overloaded", status_code=429, error_type="overloaded",
    )


def timed_out(reason: str, limit: float | None, status: int,
              retry_after: float | None = None) -> RequestError:
    """The refusal of a request ended by a deadline before it sent anything: 503 for
    --queue-timeout (with Retry-After), 504 for --request-timeout."""
    setting = "--queue-timeout" if reason == "queue_timeout" else "--request-timeout"
    where = "waiting to be scheduled" if reason == "queue_timeout" else "in all"
    return RequestError(
        f"the request took longer than {limit or 0:g} s {where} ({setting}) and was stopped",
        code=reason, status_code=status,
        error_type="service_unavailable" if status == 503 else "timeout_error",
        retry_after=retry_after,
    )
