"""Sequence: the one state object of a request inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backends.base import SamplingParams, TokenInfo

if TYPE_CHECKING:
    import torch

    from backends.native.structured.matcher import GrammarMatcher
    from backends.text.detokenizer import IncrementalDetokenizer
    from backends.text.reasoning import ReasoningSplitter
    from backends.text.stop_checker import StopChecker


class SequenceStatus(enum.Enum):
    NEW = "new"  # a choice waiting to be forked off choice 0 (not in the scheduler yet)
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class OutputState:
    """The engine's text state of one choice: its streamed detokenization, the stop strings
    held back, and the prompt's logprobs by position (until choice 0's first output)."""

    detokenizer: IncrementalDetokenizer
    stops: StopChecker
    prompt_logprobs: dict[int, TokenInfo] = field(default_factory=dict)
    reasoning: ReasoningSplitter | None = None  # a thinking model's reasoning / content split


@dataclass
class PoolState:
    """An embedding sequence's pooling so far (native/embedding.py): the float32 sum of its
    pooled rows (mean), or its one pooled row (cls, last token), and how many rows."""

    mode: str  # "mean", "cls" or "last"
    total: torch.Tensor | None = None
    rows: int = 0

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read positions a prefix cache hit would skip."""
        return self.mode != "last"


@dataclass(frozen=True)
class TokenTable:
    """Token ids (long) and, for a bias, the amounts (the logits' dtype) on one device: a
    sequence's logit_bias or stop tokens, made once (native/sampling/token_tables.py)."""

    width: int
    dtype: torch.dtype
    device: torch.device
    tokens: torch.Tensor
    values: torch.Tensor | None = None

    def fits(self, logits: torch.Tensor) -> bool:
        return (self.width, self.dtype, self.device) == (
            logits.shape[1], logits.dtype, logits.device)


@dataclass
class Sequence:
    """Tokens, progress and KV blocks of one request.

    `num_computed_tokens` counts tokens whose K/V sit in the cache; the scheduler
    advances it, the runner reads it, the block manager edits only `block_table`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float | None] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix cache progress: blocks of block_table keyed so far, the last one's digest,
    # and whether keying stopped (a block's content was already cached elsewhere).
    keyed_blocks: int = 0
    last_key: int | None = None
    keying_stopped: bool = False
    # Choice `index` of request `group_id` (n > 1: one sequence per choice, forked from
    # choice 0 once the prompt is computed); group_id defaults to request_id.
    group_id: str = ""
    index: int = 0
    unforked: list[Sequence] = field(default_factory=list)  # choices to fork off this one
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | None = None
    # Set by the engine (llm_engine.py). Choice 0 lists every choice of its request.
    choices: list[Sequence] = field(default_factory=list)
    output: OutputState | None = None
    grammar: GrammarMatcher | None = None  # a structured-output request's constraint
    # A sampled choice draws from its own generator, seeded with `seed` (reported at the end).
    seed: int | None = None
    generator: torch.Generator | None = None
    # logit_bias and the stop tokens as tensors, made at the first step that needs them
    bias_table: TokenTable | None = None
    stop_table: TokenTable | None = None
    first_scheduled: float | None = None  # time.monotonic() of its first step; None: queued
    # Prompt tokens the prefix cache held when it was first scheduled (usage's cached_tokens;
    # a recompute after preemption finds its own blocks and does not count).
    cached_tokens: int = 0
    # An embedding model's sequence: a prompt that is pooled, never sampled (None: generation).
    pool: PoolState | None = None
    finished_at: float | None = None  # time.monotonic() when it finished

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.group_id:
            self.group_id = self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked and not produced yet: every prompt position's logits are
        needed, so the prefix cache is skipped."""
        return self.sampling.prompt_logprobs is not None and not self.num_output_tokens

    @property
    def skips_prefix_cache(self) -> bool:
        """Every prompt position must be computed: prompt logprobs, or a pooling that reads
        them all."""
        return self.needs_prompt_logits or (
            self.pool is not None and self.pool.needs_every_position)

    @property
    def max_total_tokens(self) -> int:
        """Tokens this sequence can ever hold: prompt plus its generation limit."""
        return self.num_prompt_tokens + self.max_tokens

    def append_token(self, token_id: int, logprob: float | None) -> None:
        self.token_ids.append(token_id)
        self.output_logprobs.append(logprob)
