"""Structured outputs for the native engine: grammars compiled by llguidance, token masks.

`GrammarCompiler.compile` turns a `StructuredOutput` into a `CompiledGrammar` (cached); each
sequence gets its own `GrammarMatcher` from it; each step `TokenMasks.fill` computes the packed
bitmask of every constrained row at once (GIL released) and `apply_token_bitmask` sends the
forbidden logits to -inf.
"""

from backends.native.structured.compiler import CompiledGrammar, GrammarCompiler
from backends.native.structured.grammar import GrammarError
from backends.native.structured.masks import TokenMasks, apply_token_bitmask
from backends.native.structured.matcher import GrammarMatcher

__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarError",
    "GrammarMatcher",
    "TokenMasks",
    "apply_token_bitmask",
]
