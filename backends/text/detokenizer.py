"""Streaming detokenization: text deltas from token ids, never a partial UTF-8 character.

The prefix-offset / read-offset technique of vLLM and TGI: decode a short window of previous
tokens with and without the new ones and emit the difference, because decoding a suffix alone
can differ from the full decode (leading-space handling, bytes split across tokens).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from backends.text.tokenizer import Tokenizer

# How many prompt tokens the first window reaches back, as in vLLM.
_INITIAL_WINDOW = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids or [])
        self._prefix_offset = max(len(self._ids) - _INITIAL_WINDOW, 0)
        self._read_offset = len(self._ids)
        self._parts: list[str] = []

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text ("" while it is held back)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._parts.append(delta)
        return delta

    @property
    def text(self) -> str:
        return "".join(self._parts)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode_window(ids, skip_special_tokens=self._skip_special)
