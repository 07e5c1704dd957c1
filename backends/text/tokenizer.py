"""The tokenizer every local backend uses: encoding, chat templates, decoding; plus the
streaming helpers beside it (incremental detokenizer, stop checker).

Wraps a transformers fast tokenizer; the native engine's loading builds one from a folder or a
GGUF file (backends/native/loading/tokenizer_loading.py), the transformers backend from its
folder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jinja2
import transformers
from transformers.tokenization_utils_tokenizers import TokenizersBackend

from backends.text.detokenizer import IncrementalDetokenizer
from backends.text.reasoning import ReasoningMarkers
from backends.text.stop_checker import StopChecker

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "StopChecker", "Tokenizer"]


class ChatTemplateError(ValueError):
    """The chat template is missing or rejected the messages (a client error: 400)."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param  # the request field at fault


class Tokenizer:
    def __init__(
        self, hf: transformers.PreTrainedTokenizerBase, extra_eos_token_ids: Sequence[int] = ()
    ) -> None:
        self.hf = hf
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self.chat_template: str | None = hf.chat_template
        eos = [hf.eos_token_id] if hf.eos_token_id is not None else []
        self.eos_token_ids: frozenset[int] = frozenset([*eos, *extra_eos_token_ids])
        special = {i for i, tok in hf.added_tokens_decoder.items() if tok.special}
        self._special_ids: frozenset[int] = frozenset(special | set(hf.all_special_ids))
        # A thinking model's <think> / </think> ids (None: the model does not reason).
        self.reasoning_markers = ReasoningMarkers.from_added_tokens(hf.added_tokens_decoder)
        self.from_cache = False  # a GGUF tokenizer read back from the startup cache
        self._window_decoder = _backend_decoder(hf)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with BOS/EOS where the tokenizer adds them."""
        return list(self.hf(text).input_ids)

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Exactly transformers' apply_chat_template(..., tools=tools, tokenize=True), with
        `template_kwargs` as extra template variables (e.g. `enable_thinking`)."""
        if not self.chat_template:
            raise ChatTemplateError(
                "This model has no chat template; use the completions endpoint with a prompt."
            )
        extra = _template_variables(template_kwargs)
        try:
            ids = self.hf.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                tokenize=True, return_dict=False, **extra,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"The chat template rejected the messages: {exc}") from exc
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            raise ChatTemplateError(f"Cannot apply the chat template: {exc}") from exc
        return list(ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_window(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Decode without transformers' space clean-up, which is not local to a window."""
        if self._window_decoder is not None:
            return self._window_decoder(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(
            ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids


# apply_chat_template's own parameters: a template variable may not take their place.
_RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "processor_kwargs",
})


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The client's extra template variables; ChatTemplateError for one that would override
    how the template is applied rather than feed it."""
    variables = dict(kwargs or {})
    clashing = sorted(name for name in variables
                      if name in _RESERVED_TEMPLATE_NAMES or not name.isidentifier())
    if clashing:
        raise ChatTemplateError(
            f"chat_template_kwargs may not set {', '.join(map(repr, clashing))}: only "
            "template variables (such as enable_thinking) are accepted", "chat_template_kwargs")
    return variables


def _backend_decoder(hf: transformers.PreTrainedTokenizerBase) -> Callable[..., str] | None:
    """The `tokenizers` decode that transformers' decode (without clean-up) calls, where the
    tokenizer class overrides neither: two calls a streamed token, and transformers' wrapper
    around each cost several times the Rust decode itself."""
    plain = (type(hf).decode is transformers.PreTrainedTokenizerBase.decode
             and type(hf)._decode is TokenizersBackend._decode)
    backend = getattr(hf, "_tokenizer", None)
    return backend.decode if plain and backend is not None else None
