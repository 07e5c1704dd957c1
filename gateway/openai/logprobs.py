"""Logprobs in OpenAI's exact shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}, ...]}, ...], "refusal": null}`. Completions (the legacy shape):
`{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`, where `top_logprobs` holds
one `{token text: logprob}` object per token with the `logprobs` most likely tokens plus
the chosen one (so up to `logprobs + 1` entries, as OpenAI documents), or is null when
`logprobs` is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from backends.base import TokenInfo, TopLogprob

JSON = dict[str, Any]


def finite(logprob: float | None) -> float:
    # -9999.0 is OpenAI's own stand-in for "too unlikely to represent".
    return logprob if logprob is not None and math.isfinite(logprob) else -9999.0


def _alternative(alt: TopLogprob) -> JSON:
    return {"token": alt.text, "logprob": finite(alt.logprob),
            "bytes": list(alt.text.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[TokenInfo], top: int) -> JSON:
    content = [
        {"token": t.text, "logprob": finite(t.logprob), "bytes": list(t.text.encode("utf-8")),
         "top_logprobs": [_alternative(a) for a in t.top_logprobs[:top]]}
        for t in tokens
    ]
    return {"content": content, "refusal": None}


def _top_dict(token: TokenInfo, top: int) -> dict[str, float]:
    alternatives: dict[str, float] = {}
    for alt in token.top_logprobs[:top]:  # most likely first; equal texts keep the likeliest
        alternatives.setdefault(alt.text, finite(alt.logprob))
    alternatives.setdefault(token.text, finite(token.logprob))
    return alternatives


class CompletionLogprobs:
    """One choice's completion logprobs, chunk by chunk (`text_offset` runs across chunks)."""

    def __init__(self, top: int) -> None:
        self.top = top
        self._offset = 0

    def of(self, tokens: Sequence[TokenInfo]) -> JSON:
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t.text)
        return {
            "tokens": [t.text for t in tokens],
            "token_logprobs": [finite(t.logprob) for t in tokens],
            "top_logprobs": [_top_dict(t, self.top) for t in tokens] if self.top else None,
            "text_offset": offsets,
        }
