"""Reading a JSON request body into a schema, with OpenAI-shaped 400s for every mistake.

A body nesting deeper than `MAX_JSON_DEPTH` is refused before it is parsed
(gateway/json_depth.py), so no recursion on client data downstream can run out of stack.
Large bodies (over `LARGE_BODY_BYTES`, or of unknown length) are read and parsed at most
`LARGE_PARSES` at a time, the parse in a worker thread: a parsed body takes many times its
size in Python objects (`[{},{},...]` about 25x), so forty parallel 8 MiB bodies would
otherwise be held, and expanded, together; the others wait unread, their bytes still in
the network buffers.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request, from_validation_errors, param_path
from gateway.json_depth import MAX_JSON_DEPTH, too_deep

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


LARGE_BODY_BYTES = 1024**2
LARGE_PARSES = 1  # parsing holds the GIL anyway: more at once would only add memory
# Only text with one of these can decode to a lone surrogate (json.loads reads bytes with
# "surrogatepass"): a \uD800-\uDFFF escape, or such a code point encoded as UTF-8.
_MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_GATE_ATTR = "large_body_parses"  # the app's semaphore, made on first use (in its loop)
TOO_DEEP = (f"The request body nests arrays and objects more than {MAX_JSON_DEPTH} levels "
            "deep; this server accepts at most that.")


async def read_json(request: Request) -> Any:
    if not _is_large(request):
        return _parsed(await request.body())
    async with _large_parses(request):
        raw = await request.body()
        return await asyncio.to_thread(_parsed, raw)


def _parsed(raw: bytes) -> Any:
    if not raw.strip():
        raise bad_request("The request body is empty; send a JSON object.")
    if too_deep(raw):
        raise bad_request(TOO_DEEP, code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except RecursionError:  # only for text that is not JSON: the depth was measured
        raise bad_request(TOO_DEEP, code="invalid_json") from None
    except ValueError as exc:
        message = f"The request body is not valid JSON: {exc}"
        raise bad_request(message, code="invalid_json") from None
    if _MAYBE_SURROGATE.search(raw):
        _refuse_lone_surrogates(data)
    return data


def _refuse_lone_surrogates(data: Any) -> None:
    where = lone_surrogate(data)
    if where is not None:
        param = param_path(where)
        message = f"Invalid value for '{param}': {LONE_SURROGATE}" if param else LONE_SURROGATE
        raise bad_request(message, param, "invalid_value")


def _is_large(request: Request) -> bool:
    length = request.headers.get("content-length")
    return not (length and length.isdecimal() and int(length) <= LARGE_BODY_BYTES)


def _large_parses(request: Request) -> asyncio.Semaphore:
    gate = getattr(request.app.state, _GATE_ATTR, None)
    if gate is None:
        gate = asyncio.Semaphore(LARGE_PARSES)
        setattr(request.app.state, _GATE_ATTR, gate)
    return gate


def _bad_text(value: Any) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _items(value: Any) -> Iterator[tuple[int | str, Any]]:
    return iter(value.items()) if isinstance(value, dict) else enumerate(value)


def lone_surrogate(data: Any) -> tuple[int | str, ...] | None:
    """Where the first string (or key) that cannot be encoded is, if any: `\\ud800` escapes
    decode to such strings, and no tokenizer, store or JSON answer can take them."""
    if _bad_text(data):
        return ()
    if not isinstance(data, dict | list):
        return None
    # Depth-first with one iterator per open container: memory grows with the depth only.
    where: list[int | str] = []
    stack = [_items(data)]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            if where:
                where.pop()
            continue
        key, item = step
        if _bad_text(key):
            return tuple(where)
        if _bad_text(item):
            return (*where, key)
        if isinstance(item, dict | list):
            where.append(key)
            stack.append(_items(item))
    return None


def parse_body(data: Any, schema: type[Body]) -> Body:
    """`data` from `read_json`, which already refused lone surrogates."""
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_type")
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise from_validation_errors(exc.errors()) from None
