"""The soak's traffic (bench/soak.py): mixed OpenAI / TGI requests, streams the client leaves
midway, bad bodies, and the tally of what each one got.

Each request uses one of two API keys: `kept` for requests the client reads to the end, `cut`
for streams it plans to leave midway. Usage can then be checked per key: the kept key's
usage must equal, token for token, what its clients were served; the cut key's lies between
what its clients read before leaving and what they asked for.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

WORDS = ("the ship sailed over grey water while gulls cried above the harbour and an old "
         "sailor counted the ropes coiled on the deck before the storm came in from the west "
         "carrying rain salt wind and the smell of distant islands").split()
SYSTEM = "You are a patient assistant who answers questions about the sea. " * 3
STREAM_KINDS = ("chat_stream", "completion_stream", "generate_stream")
KINDS = ("chat", "completion", "generate", *STREAM_KINDS)


@dataclass
class Result:
    """One request's outcome: `ok` (read to its end), `cut` (left midway on purpose),
    `client_error`, `overloaded` (429), `unavailable` (503) or `failed` (anything else)."""

    outcome: str
    key: str  # "kept" or "cut"
    tokens: int = 0  # completion tokens the client received
    asked: int = 0  # max tokens the request asked for
    at: float = 0.0  # time.monotonic() when it ended
    detail: str = ""


@dataclass
class Tally:
    results: list[Result] = field(default_factory=list)

    def count(self, outcome: str, key: str | None = None) -> int:
        return sum(r.outcome == outcome and key in (None, r.key) for r in self.results)

    def tokens(self, key: str, outcomes: tuple[str, ...] = ("ok",)) -> int:
        return sum(r.tokens for r in self.results if r.key == key and r.outcome in outcomes)

    def asked(self, key: str) -> int:
        return sum(r.asked for r in self.results if r.key == key and r.outcome in ("ok", "cut"))

    def summary(self) -> dict[str, int]:
        names = ("ok", "cut", "client_error", "overloaded", "unavailable", "failed")
        return {name: self.count(name) for name in names}


def _text(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _body(kind: str, model: str, rng: random.Random, max_tokens: int) -> tuple[str, dict]:
    stream = kind in STREAM_KINDS
    if kind.startswith("chat"):
        messages = [{"role": "user", "content": _text(rng, 4, 40)}]
        if rng.random() < 0.5:  # a shared prefix: the prefix cache
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body = {"model": model, "messages": messages, "max_tokens": max_tokens,
                "temperature": rng.choice([0.0, 0.8]), "stream": stream}
        return "/v1/chat/completions", _with_usage(body, stream)
    if kind.startswith("completion"):
        body = {"model": model, "prompt": _text(rng, 4, 60), "max_tokens": max_tokens,
                "temperature": rng.choice([0.0, 1.0]), "stream": stream}
        return "/v1/completions", _with_usage(body, stream)
    # `details`: TGI's last stream event then carries generated_tokens
    body = {"inputs": _text(rng, 4, 60),
            "parameters": {"max_new_tokens": max_tokens, "details": stream}}
    return ("/generate_stream" if stream else "/generate"), body


def _with_usage(body: dict, stream: bool) -> dict:
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def bad_request(rng: random.Random, model: str) -> tuple[str, Any]:
    """A body the server must refuse with a 4xx (bytes: sent as is)."""
    return rng.choice([
        ("/v1/chat/completions", b"{not json"),
        ("/v1/chat/completions", {"model": model, "messages": "not a list"}),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1}),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": []}),
        ("/generate", {"inputs": "", "parameters": {"max_new_tokens": 4}}),
        ("/v1/completions", {"model": model, "prompt": "x", "temperature": "hot"}),
    ])


def _status_outcome(status: int) -> str:
    if status == 429:
        return "overloaded"
    if status == 503:
        return "unavailable"
    return "client_error" if 400 <= status < 500 else "failed"


async def send_bad(http: httpx.AsyncClient, path: str, body: Any, key: str) -> Result:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = await http.post(path, content=content, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    # 429 / 503 come before the body is read (admission; keys need Redis): the same
    # outcomes as for a good body, so a 503 outside the Redis outage still fails the soak
    outcome = _status_outcome(response.status_code)
    return Result(outcome, "kept", detail=f"bad body to {path}: {response.status_code}")


async def send(http: httpx.AsyncClient, kind: str, model: str, rng: random.Random,
               keys: dict[str, str], cut_share: float) -> Result:
    """One good request of `kind`; a stream is left midway with probability `cut_share`."""
    max_tokens = rng.randint(4, 48)
    path, body = _body(kind, model, rng, max_tokens)
    cut_after = None
    if kind in STREAM_KINDS and rng.random() < cut_share:
        cut_after = rng.randint(1, max(1, max_tokens // 2))
    key = "cut" if cut_after is not None else "kept"
    headers = {"Authorization": f"Bearer {keys[key]}"}
    if kind in STREAM_KINDS:
        result = await _stream(http, path, body, headers, cut_after)
    else:
        result = await _whole(http, path, body, headers)
    result.key, result.asked = key, max_tokens
    return result


async def _whole(http: httpx.AsyncClient, path: str, body: dict,
                 headers: dict[str, str]) -> Result:
    response = await http.post(path, json=body, headers=headers)
    if response.status_code != 200:
        return Result(_status_outcome(response.status_code), "",
                      detail=f"{path}: {response.status_code} {response.text[:200]}")
    if path == "/generate":
        return Result("ok", "", int(response.headers["x-generated-tokens"]))
    return Result("ok", "", int(response.json()["usage"]["completion_tokens"]))


async def _stream(http: httpx.AsyncClient, path: str, body: dict, headers: dict[str, str],
                  cut_after: int | None) -> Result:
    async with http.stream("POST", path, json=body, headers=headers) as response:
        if response.status_code != 200:
            await response.aread()
            return Result(_status_outcome(response.status_code), "",
                          detail=f"{path}: {response.status_code} {response.text[:200]}")
        seen, usage = 0, None
        async for line in response.aiter_lines():
            event = _event(line)
            if event is None:
                continue
            if "error" in event:
                return Result("failed", "", seen, detail=f"{path}: stream error {event}")
            seen += _tokens_in(event)
            usage = _usage_in(event, usage)
            if cut_after is not None and seen >= cut_after and usage is None:
                return Result("cut", "", seen)
    if usage is None:
        return Result("failed", "", seen, detail=f"{path}: stream ended without usage")
    return Result("ok", "", usage)


def _event(line: str) -> dict | None:
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    return json.loads(data)


def _tokens_in(event: dict) -> int:
    """Tokens one event carried (an OpenAI chunk with text: one; a TGI token event: one)."""
    if "token" in event:
        return 1
    choices = event.get("choices") or []
    return sum(bool(c.get("text") or (c.get("delta") or {}).get("content")) for c in choices)


def _usage_in(event: dict, usage: int | None) -> int | None:
    if event.get("usage"):
        return int(event["usage"]["completion_tokens"])
    details = event.get("details")
    if details and "generated_tokens" in details:
        return int(details["generated_tokens"])
    return usage


async def one(http: httpx.AsyncClient, model: str, rng: random.Random, keys: dict[str, str],
              cut_share: float, bad_share: float, timeout_s: float) -> Result:
    """A random request, never raising: a timeout (a hang) or a transport error is `failed`."""
    try:
        if rng.random() < bad_share:
            result = await send_bad(http, *bad_request(rng, model), keys["kept"])
        else:
            result = await send(http, rng.choice(KINDS), model, rng, keys, cut_share)
    except httpx.TimeoutException as exc:
        result = Result("failed", "kept", detail=f"no answer within {timeout_s:g} s: {exc!r}")
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        result = Result("failed", "kept", detail=f"{type(exc).__name__}: {exc}")
    result.at = time.monotonic()
    return result
