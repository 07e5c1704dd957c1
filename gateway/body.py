"""Reading a JSON request body into a schema, with OpenAI-shaped 400s for every mistake."""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request, from_validation_errors, param_path

Body = TypeVar("Body", bound=BaseModel)
LONE_SURROGATE = "string contains invalid unicode (a lone surrogate)"


class _NotANumber(ValueError):
    """NaN, Infinity, or a number beyond a double: Python's json reads them, JSON has none."""


def _constant(name: str) -> float:
    raise _NotANumber(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotANumber(f"the number {text[:40]} is out of range")
    return value


async def read_json(request: Request) -> Any:
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    try:
        return json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:
        message = f"The request body is not valid JSON: {exc}"
        raise bad_request(message, code="invalid_json") from None


def _bad_text(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate(data: Any) -> tuple[int | str, ...] | None:
    """Where the first string (or key) that cannot be encoded is, if any: `\\ud800` escapes
    decode to such strings, and no tokenizer, store or JSON answer can take them."""
    stack: list[tuple[tuple[int | str, ...], Any]] = [((), data)]
    while stack:  # iterative: bodies nest as deep as the JSON parser allows
        where, value = stack.pop()
        if _bad_text(value):
            return where
        items: Any = value.items() if isinstance(value, dict) else enumerate(value) \
            if isinstance(value, list) else ()
        children = []
        for key, item in items:
            if _bad_text(key):
                return where
            children.append(((*where, key), item))
        stack.extend(reversed(children))
    return None


def parse_body(data: Any, schema: type[Body]) -> Body:
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    where = lone_surrogate(data)
    if where is not None:
        param = param_path(where)
        message = f"Invalid value for '{param}': {LONE_SURROGATE}" if param else LONE_SURROGATE
        raise bad_request(message, param, "invalid_value")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
