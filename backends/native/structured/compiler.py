"""Compiling constraints against the model's tokenizer, with an LRU cache of the results."""

from __future__ import annotations

import threading
from collections import OrderedDict

import llguidance
import llguidance.hf
from llguidance import LLMatcher

from backends.base import StructuredOutput
from backends.native.structured.grammar import GrammarError, describe, grammar_text
from backends.native.structured.matcher import GrammarMatcher
from backends.text.tokenizer import Tokenizer


class CompiledGrammar:
    """A compiled constraint; `matcher()` hands out independent states at its start."""

    def __init__(self, spec: StructuredOutput, template: LLMatcher, engine_vocab: int) -> None:
        self.spec = spec
        self._template = template  # never advanced: only copied
        self._engine_vocab = engine_vocab

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._template.deep_copy(), self._engine_vocab)


class GrammarCompiler:
    """Compiles `StructuredOutput`s for one tokenizer. Thread-safe; the llguidance tokenizer
    (~0.4 s for a 49k vocabulary) is built once here and shared by every grammar.

    `vocab_size` is the logits' width: masks have that many tokens; ids past the tokenizer's
    own vocabulary (padding rows of the LM head) are never allowed.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 64) -> None:
        # Logits narrower than the tokenizer: the engine still needs every token it may decode;
        # TokenMasks cuts the masks to the logits' width.
        n_vocab = max(vocab_size, len(tokenizer.hf))
        # Without an EOS a special token stands in: allowed where the grammar may end, and
        # accepting it terminates the matcher (the engine then stops).
        eos = sorted(tokenizer.eos_token_ids) or tokenizer.hf.all_special_ids[:1]
        if not eos:
            raise ValueError("structured outputs need a tokenizer with an EOS or special token")
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=n_vocab,
                                                       eos_token=eos)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar for `spec` (cached by kind and spec); GrammarError naming the
        problem when it cannot be compiled."""
        key = (spec.kind, "" if spec.kind == "json_object" else spec.spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        # Unlocked: compiling may be slow.
        compiled = CompiledGrammar(spec, self._build(spec), self._tokenizer.vocab_size)
        with self._lock:
            compiled = self._cache.setdefault(key, compiled)  # a racing compile may have won
            self._cache.move_to_end(key)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutput) -> LLMatcher:
        grammar = grammar_text(spec)
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)  # compiles, GIL released
        if matcher.is_error():
            raise GrammarError(_error_message(spec, matcher.get_error()))
        return matcher


def _error_message(spec: StructuredOutput, error: str) -> str:
    message = f"Cannot compile the {describe(spec.kind)}: {error.strip()}"
    if "Unimplemented keys" in error:
        message += " (the grammar engine does not support these keywords; remove them)"
    return message
