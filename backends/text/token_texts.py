"""The text of single tokens, for logprob alternatives."""

from __future__ import annotations

from backends.base import TopLogprob
from backends.text.tokenizer import Tokenizer


class TokenTexts:
    """The text of single tokens (an alternative has no context to detokenize in), cached:
    a step may name twenty alternatives per sequence."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            self._texts[token_id] = text
        return text

    def top(self, pairs: list[tuple[int, float]]) -> tuple[TopLogprob, ...]:
        return tuple(TopLogprob(t, self(t), lp) for t, lp in pairs)
