"""The model's tokenizer, for HTTP backends: token counts (limits, usage when an upstream gives
none) and chat templates (TGI's /generate has no chat).

A Hugging Face folder is read with `tokenizers` and `jinja2` alone, so these backends stay free
of torch; a .gguf file goes through transformers' GGUF conversion (which loads torch).
Without a tokenizer, counts are estimated erring high (`estimate_tokens`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backends.base import GenerationRequest, RequestError


class ChatTokenizer(Protocol):
    vocab_size: int  # ids 0 .. vocab_size - 1 decode
    chat_template: str | None  # the template's source

    def encode(self, text: str, *, special: bool) -> list[int]: ...

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str: ...

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...

    def adds_bos(self) -> str | None:
        """The BOS token's text when encoding adds it by itself, else None."""
        ...


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # a serialized AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)


def _template_env() -> ImmutableSandboxedEnvironment:
    """The environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    file = folder / "chat_template.jinja"
    if file.is_file():
        return file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        return named.get("default")
    return template if isinstance(template, str) else None


class FolderTokenizer:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja), as transformers saves."""

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        root = Path(folder)
        self._tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        config_file = root / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        self._special = {
            name: text for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template: str | None = _chat_template(root, config)
        source = self.chat_template
        self._template = _template_env().from_string(source) if source else None

    def encode(self, text: str, *, special: bool) -> list[int]:
        return self._tok.encode(text, add_special_tokens=special).ids

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self._template is None:
            raise RequestError("This model's tokenizer has no chat template; use a text prompt.",
                               param="messages")
        try:
            return self._template.render(  # `tools` as transformers' apply_chat_template passes
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                **self._special)
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, ValueError) as exc:
            # templates index and concatenate message fields: odd messages fail either way
            raise RequestError(f"The chat template rejected the messages: {exc}",
                               param="messages") from None

    def adds_bos(self) -> str | None:
        bos = self._special.get("bos_token")
        if bos is None:
            return None
        first = self._tok.encode("", add_special_tokens=True).ids[:1]
        return bos if first and first == [self._tok.token_to_id(bos)] else None


class GGUFTokenizer:
    """A .gguf file's tokenizer through transformers' conversion (imports torch)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        folder, name = os.path.split(os.path.abspath(path))
        self._hf = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
        self.vocab_size: int = len(self._hf)
        self.chat_template: str | None = self._hf.chat_template

    def encode(self, text: str, *, special: bool) -> list[int]:
        return list(self._hf(text, add_special_tokens=special).input_ids)

    def decode(self, ids: list[int], *, skip_special: bool = True) -> str:
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        try:
            return self._hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=tools,
                tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise RequestError(f"Cannot apply the chat template: {exc}",
                               param="messages") from None

    def adds_bos(self) -> str | None:
        bos = self._hf.bos_token
        ids = self._hf("", add_special_tokens=True).input_ids
        return bos if bos is not None and ids[:1] == [self._hf.bos_token_id] else None


def load_tokenizer(path: str) -> ChatTokenizer:
    return GGUFTokenizer(path) if path.endswith(".gguf") else FolderTokenizer(path)


_ASCII = bytes(range(128))
_LETTERS = bytes(c for c in range(128) if chr(c).isalpha())
_SINGLES = bytes(c for c in range(128) if not chr(c).isalpha() and c != 32)  # + line breaks
# Every byte but the letters -> a space, so that split() gives the runs of letters.
_WORDS = bytes(c if chr(c).isalpha() and c < 128 else 32 for c in range(256))
MESSAGE_OVERHEAD_TOKENS = 8  # a chat template's role markers, per message


def estimate_tokens(text: str) -> int:
    """Tokens of `text` without its tokenizer, erring high (the count is reserved against a
    key's budget and the upstream's window): a token per 4 letters of an ASCII word, rounded
    up (OpenAI's rule of thumb for English), a token per digit, punctuation mark, line break
    and pair of spaces, and a token per UTF-8 byte of anything else (byte-level BPE never
    needs more, while CJK text takes 1-3 a character: 2-4x what 4 characters a token says)."""
    raw = text.encode("utf-8", "surrogatepass")
    non_ascii = len(raw.translate(None, _ASCII))
    singles = len(raw) - len(raw.translate(None, _SINGLES))
    letters = len(raw) - len(raw.translate(None, _LETTERS))
    words = len(raw.translate(_WORDS).split())
    return non_ascii + singles + (letters + 3 * words) // 4 + raw.count(b"  ")


class TokenCounter:
    """Prompt and completion token counts: exact with a tokenizer, else estimated."""

    def __init__(self, tokenizer: ChatTokenizer | None) -> None:
        self.tokenizer = tokenizer

    @property
    def source(self) -> str:
        return "tokenizer" if self.tokenizer is not None else "estimate"

    def prompt_text(self, req: GenerationRequest) -> str:
        """The text the model reads: the rendered chat template, or the prompt."""
        if req.messages is not None:
            if self.tokenizer is None:
                return "\n".join(str(m.get("content", "")) for m in req.messages)
            return self.tokenizer.render_chat(req.messages, req.add_generation_prompt,
                                              req.tools)
        if req.prompt_token_ids is not None and self.tokenizer is not None:
            return self.tokenizer.decode(list(req.prompt_token_ids))
        return req.prompt or ""

    def prompt_ids(self, req: GenerationRequest) -> list[int]:
        if req.prompt_token_ids is not None:
            return list(req.prompt_token_ids)
        if self.tokenizer is None:
            raise RequestError(
                "this deployment cannot tokenize prompts: give its backend a `tokenizer` option",
                code="tokenizer_required")
        if req.messages is not None:  # the template spells out its special tokens
            return self.tokenizer.encode(self.prompt_text(req), special=False)
        return self.tokenizer.encode(req.prompt or "", special=True)

    def prompt_tokens(self, req: GenerationRequest) -> int:
        if req.prompt_token_ids is not None:
            return len(req.prompt_token_ids)
        if self.tokenizer is None:
            overhead = MESSAGE_OVERHEAD_TOKENS * len(req.messages or ())
            return estimate_tokens(self.prompt_text(req)) + overhead
        return len(self.prompt_ids(req))

    def detokenize(self, token_ids: list[int]) -> str:
        """vLLM's /detokenize: the text of `token_ids`, special tokens included."""
        if self.tokenizer is None:
            raise RequestError(
                "this deployment cannot detokenize: give its backend a `tokenizer` option",
                param="tokens", code="tokenizer_required")
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise RequestError(f"token ids must be within the vocabulary (0 to {vocab - 1})",
                               param="tokens")
        return self.tokenizer.decode(list(token_ids), skip_special=False)

    def completion_tokens(self, text: str) -> int:
        if self.tokenizer is None:
            return estimate_tokens(text)
        return len(self.tokenizer.encode(text, special=False))
