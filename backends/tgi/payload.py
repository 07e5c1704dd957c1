"""GenerationRequest -> TGI's `/generate_stream` body.

TGI refuses temperature <= 0 and top_p >= 1, so greedy is `do_sample: false` and neutral
values are left out. A null `max_new_tokens` asks TGI for the rest of the context window
(its default, 100, applies only when the field is absent).
"""

from __future__ import annotations

from typing import Any

from backends.base import RequestError, SamplingParams


def _refuse_unsupported(s: SamplingParams) -> None:
    unsupported = {
        "presence_penalty": s.presence_penalty != 0.0,
        "stop_token_ids": bool(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
    }
    for name, asked in unsupported.items():
        if asked:
            raise RequestError(f"`{name}` is not supported by this model's TGI backend",
                               param=name, code="unsupported_parameter")


def build_payload(inputs: str, s: SamplingParams) -> dict[str, Any]:
    _refuse_unsupported(s)
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens, "details": True, "decoder_input_details": False,
        "stop": list(s.stop), "do_sample": s.temperature > 0,
    }
    if s.repetition_penalty != 1.0:
        params["repetition_penalty"] = s.repetition_penalty
    if s.frequency_penalty:
        params["frequency_penalty"] = s.frequency_penalty
    if s.temperature > 0:
        params["temperature"] = s.temperature
        if 0.0 < s.top_p < 1.0:
            params["top_p"] = s.top_p
        if s.top_k > 0:
            params["top_k"] = s.top_k
        if s.seed is not None:
            params["seed"] = s.seed
    return {"inputs": inputs, "parameters": params}
