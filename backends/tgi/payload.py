"""GenerationRequest -> TGI's `/generate_stream` (or `/generate`) body.

TGI refuses temperature <= 0 and top_p >= 1, so greedy is `do_sample: false` and neutral
values are left out. A null `max_new_tokens` asks TGI for the rest of the context window
(its default, 100, applies only when the field is absent); the backend sends none, it bounds
the request first (`UpstreamBackend.bounded`). What TGI has no parameter for is
refused with a 400 naming it, before anything is sent.
"""

from __future__ import annotations

import json
from typing import Any

from backends.base import RequestError, SamplingParams, StructuredOutput


def _unsupported(name: str, why: str = "") -> RequestError:
    return RequestError(f"`{name}` is not supported by this model's TGI backend{why}",
                        param=name, code="unsupported_parameter")


def _refuse_unsupported(s: SamplingParams) -> None:
    unsupported = {
        "presence_penalty": s.presence_penalty != 0.0,
        "stop_token_ids": bool(s.stop_token_ids),
        "ignore_eos": s.ignore_eos,
        "logit_bias": bool(s.logit_bias),
        "min_tokens": s.min_tokens > 0,
        "min_p": s.min_p > 0.0,
    }
    for name, asked in unsupported.items():
        if asked:
            raise _unsupported(name)
    if s.n > 1:  # TGI's best_of samples several but answers with one
        raise _unsupported("n", " (TGI answers one choice per request): use n = 1")


def _grammar(spec: StructuredOutput) -> dict[str, Any]:
    """TGI's `grammar`: {"type": "json", "value": schema} or {"type": "regex", "value": ...}."""
    if spec.kind == "json_object":
        return {"type": "json", "value": {"type": "object"}}
    if spec.kind == "json_schema":
        try:
            return {"type": "json", "value": json.loads(spec.spec)}
        except ValueError:
            raise RequestError("the JSON schema is not valid JSON", param=spec.source) from None
    if spec.kind == "regex":
        return {"type": "regex", "value": spec.spec}
    raise RequestError("grammars (`lark`) are not supported by this model's TGI backend: "
                       "use a JSON schema or a regex", param=spec.source,
                       code="unsupported_parameter")


def build_payload(inputs: str, s: SamplingParams) -> dict[str, Any]:
    _refuse_unsupported(s)
    params: dict[str, Any] = {
        "max_new_tokens": s.max_tokens, "details": True,
        "decoder_input_details": s.prompt_logprobs is not None,
        "stop": list(s.stop), "do_sample": not s.is_greedy,
    }
    if s.repetition_penalty != 1.0:
        params["repetition_penalty"] = s.repetition_penalty
    if s.frequency_penalty:
        params["frequency_penalty"] = s.frequency_penalty
    if s.logprobs and s.top_logprobs:
        params["top_n_tokens"] = s.top_logprobs
    if s.structured is not None:
        params["grammar"] = _grammar(s.structured)
    if not s.is_greedy:
        params["temperature"] = s.temperature
        if 0.0 < s.top_p < 1.0:
            params["top_p"] = s.top_p
        if s.top_k > 0:
            params["top_k"] = s.top_k
        if s.seed is not None:
            params["seed"] = s.seed
    return {"inputs": inputs, "parameters": params}
