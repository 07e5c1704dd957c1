"""The engine's side of structured outputs: one grammar compiler and one mask buffer.

The grammar engine is imported on first use, so engines that never see a constrained
request do not pay for loading it. Masks for a step are computed on a worker thread while
the forward pass runs (the grammar engine releases the GIL).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from backends.base import StructuredOutput
from backends.native.scheduling.sequence import Sequence
from backends.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    from backends.native.structured import (
        CompiledGrammar,
        GrammarCompiler,
        GrammarMatcher,
        TokenMasks,
    )


class GrammarSupport:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size  # the logits' width
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._masks: TokenMasks | None = None
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Thread-safe; raises GrammarError for a spec the engine cannot compile."""
        with self._lock:
            if self._compiler is None:
                from backends.native.structured import GrammarCompiler

                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size)
            compiler = self._compiler
        return compiler.compile(spec)

    def matcher(self, grammar: CompiledGrammar, prompt_ids: list[int]) -> GrammarMatcher:
        """A choice's matcher; for a thinking model it waits for the reasoning to end."""
        matcher = grammar.matcher()
        markers = self._tokenizer.reasoning_markers
        if markers is None:
            return matcher
        from backends.native.structured.reasoning_gate import AfterReasoning

        return AfterReasoning(matcher, markers, markers.opens_in(prompt_ids))

    def submit_masks(self, seqs: list[Sequence]) -> Future[torch.Tensor | None] | None:
        """Start filling the bitmask of `seqs`' matchers (rows in order); None when no
        sequence has a grammar. The result is valid until the next call."""
        matchers = [seq.grammar for seq in seqs]
        if all(m is None or not m.constrains for m in matchers):
            return None
        if self._masks is None:
            from backends.native.structured import TokenMasks

            self._masks = TokenMasks(self._vocab_size)
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        assert self._pool is not None
        return self._pool.submit(self._masks.fill, matchers)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
