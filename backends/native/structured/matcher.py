"""One sequence's position in its grammar: which tokens may come next, and whether it is done."""

from __future__ import annotations

from llguidance import LLMatcher


class GrammarMatcher:
    """Advances with every accepted token. EOS is allowed exactly when the text so far is a
    complete match; once nothing but EOS may follow (or EOS was accepted) `is_terminated`."""

    def __init__(self, matcher: LLMatcher, engine_vocab: int) -> None:
        self._matcher = matcher
        self._engine_vocab = engine_vocab  # ids the engine knows (an unknown one breaks it)
        self.mask_words = (engine_vocab + 31) // 32  # int32 words of the engine's mask

    def accept(self, token_id: int) -> bool:
        """Advance by `token_id`; False (state unchanged) when the grammar does not allow it."""
        if not 0 <= token_id < self._engine_vocab:
            return False
        return self._matcher.try_consume_tokens([token_id]) == 1

    @property
    def is_terminated(self) -> bool:
        """Complete: nothing but EOS may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS is allowed now)."""
        return self._matcher.is_accepting()

    @property
    def constrains(self) -> bool:
        """Whether the grammar masks the next token (a thinking model reasons freely)."""
        return True

    @property
    def also_allowed(self) -> tuple[int, ...]:
        """Token ids allowed next beside the grammar's."""
        return ()

    @property
    def engine_vocab(self) -> int:
        return self._engine_vocab

    @property
    def engine_matcher(self) -> LLMatcher:
        """The llguidance matcher (for `TokenMasks`)."""
        return self._matcher
