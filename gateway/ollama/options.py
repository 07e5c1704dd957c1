"""Ollama's `options`, `format` and `think` -> the chat (or completion) body's own fields,
and the server's request limits checked on the raw body, naming Ollama's fields.

| Ollama                  | chat completions                                  |
|-------------------------|---------------------------------------------------|
| temperature, top_p, top_k, min_p, seed, presence_penalty, frequency_penalty, stop | the same |
| num_predict (> 0)       | max_tokens (-1, -2, 0: up to the context window)  |
| repeat_penalty          | repetition_penalty                                |
| format "json" / schema  | response_format json_object / json_schema         |
| think false             | enable_thinking false for the template, no reasoning answered |
"""

from __future__ import annotations

from typing import Any

from gateway.errors import OpenAIError, bad_request
from gateway.ollama.schema import Format, OllamaOptions, Think
from gateway.settings import RequestLimits

JSON = dict[str, Any]
_SAME = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
         "frequency_penalty")


def sampling_fields(options: OllamaOptions | None) -> JSON:
    """The body fields asking for what `options` asks (what it leaves out: the defaults)."""
    if options is None:
        return {}
    out: JSON = {name: getattr(options, name) for name in _SAME
                 if getattr(options, name) is not None}
    if options.num_predict is not None and options.num_predict > 0:
        out["max_tokens"] = options.num_predict
    if options.repeat_penalty is not None:
        out["repetition_penalty"] = options.repeat_penalty
    if options.stop:
        out["stop"] = options.stop
    return out


def format_fields(value: Format | None) -> JSON:
    """`format` as the response_format the grammar engine compiles."""
    if value is None or value == "":
        return {}
    if value == "json":
        return {"response_format": {"type": "json_object"}}
    return {"response_format": {"type": "json_schema", "json_schema": {
        "name": "format", "schema": value, "strict": True}}}


def think_fields(think: Think | None) -> JSON:
    """`think: false` asks the template not to reason, and answers no reasoning."""
    if think is False:
        return {"chat_template_kwargs": {"enable_thinking": False}, "include_reasoning": False}
    return {}


def check_fields(data: Any, limits: RequestLimits) -> None:
    """The request limits on the raw body before it is validated, as the OpenAI routes do."""
    if not isinstance(data, dict):
        return
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > limits.max_messages:
        raise _too_many("messages", limits.max_messages, len(messages))
    options = data.get("options")
    if not isinstance(options, dict):
        return
    stops = options.get("stop")
    if isinstance(stops, list):
        if len(stops) > limits.max_stop_sequences:
            raise _too_many("options.stop", limits.max_stop_sequences, len(stops))
        for i, stop in enumerate(stops):
            if isinstance(stop, str) and len(stop) > limits.max_stop_length:
                raise bad_request(f"options.stop[{i}] is {len(stop)} characters long; at most "
                                  f"{limits.max_stop_length} are allowed",
                                  f"options.stop[{i}]", "string_above_max_length")
    value, cap = options.get("num_predict"), limits.max_output_tokens
    if cap is not None and isinstance(value, int) and not isinstance(value, bool) and value > cap:
        raise bad_request(f"options.num_predict is too large: {value}. This server allows at "
                          f"most {cap} generated tokens per request.", "options.num_predict",
                          "invalid_value")


def _too_many(field: str, limit: int, got: int) -> OpenAIError:
    return bad_request(f"{field} has {got} items; at most {limit} are allowed", field,
                       "array_above_max_length")
