"""Continuous batching: which sequences run each step, and how many tokens each.

One `schedule()` / `postprocess()` pair covers prefill, chunked prefill and
decode: the scheduler gives each sequence a number of new tokens per step.
Running sequences go first (one token each when decoding, the rest of their
prompt within the prefill budget otherwise; chunked, decode rows count against
that budget too); waiting ones join while the batch size, the prefill budget and
free KV blocks allow. When blocks run out, the youngest running sequence is
preempted: its blocks are freed and it goes back to the front of the queue, to
be recomputed later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backends.native.scheduling.block_manager import BlockManager
from backends.native.scheduling.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int
    max_batch_prefill_tokens: int
    chunked_prefill: bool = True
    # TGI's knobs for when waiting requests may join a running batch (chunking off).
    waiting_served_ratio: float = 1.2
    max_waiting_tokens: int = 20


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_tokens: list[int]  # new tokens computed this step, per sequence

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def samples(self, i: int) -> bool:
        """Whether sequence i reaches its last token this step, and so samples a new one."""
        seq = self.seqs[i]
        return seq.num_computed_tokens + self.num_tokens[i] == seq.num_tokens

    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample this step, in batch order (the rows of the logits)."""
        return [seq for i, seq in enumerate(self.seqs) if self.samples(i)]

    def prompt_spans(self) -> list[tuple[Sequence, int, int]]:
        """(seq, first position, count) of the prompt positions computed this step whose
        logits prompt logprobs need (position p predicts prompt token p + 1), batch order."""
        spans = []
        for seq, n in zip(self.seqs, self.num_tokens, strict=True):
            first = seq.num_computed_tokens
            count = min(first + n, seq.num_prompt_tokens - 1) - first
            if seq.needs_prompt_logits and count > 0:
                spans.append((seq, first, count))
        return spans


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.blocks = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.steps_since_join = 0
        self.last_joined = 0
        # After a failed step: its sequences, to run one per step until each caught up.
        self.solo: deque[Sequence] = deque()

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        if self.solo:
            batch = self._schedule_solo()
            if batch is not None:
                return batch
        batch = ScheduledBatch([], [])
        budget = self._schedule_running(batch, self._prefill_budget())
        had_running = bool(batch.seqs)
        joined = self._schedule_waiting(batch, budget) if self._may_join(had_running) else 0
        self.last_joined = joined
        self.steps_since_join = 0 if joined or not had_running else self.steps_since_join + 1
        return batch

    def _prefill_budget(self) -> int:
        """Prompt tokens this step may take. Chunked, decode rows count against the budget as
        in TGI v3 and vLLM, so that a step's rows stay within it (a 2048-token chunk beside
        48 decode rows ran padded to 2304 rows in the prepacked linears); at least one prompt
        token a step, so that prompts advance beside any number of decode rows."""
        budget = self.config.max_batch_prefill_tokens
        if not self.config.chunked_prefill:
            return budget
        decoding = sum(1 for seq in self.running if seq.num_uncomputed_tokens == 1)
        return max(1, budget - decoding)

    def rollback(self, seqs: list[Sequence]) -> None:
        """Undo a failed step: the sequences drop their blocks (uncached: their K/V may be
        half written), go back to the queue front in order, and will run alone (`solo`)."""
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self.running.remove(seq)
            elif seq.status is SequenceStatus.WAITING:
                self.waiting.remove(seq)
            self.blocks.free(seq, forget=True)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
        self.waiting.extendleft(reversed(seqs))
        self.solo.extend(seqs)

    def _schedule_solo(self) -> ScheduledBatch | None:
        """The first suspect alone, until it has recomputed everything but its last token
        (it then sampled once alone); None when no suspect is left."""
        while self.solo and (self.solo[0].is_finished or (
                self.solo[0].status is SequenceStatus.RUNNING
                and self.solo[0].num_uncomputed_tokens <= 1)):
            self.solo.popleft()
        if not self.solo:
            return None
        seq, batch = self.solo[0], ScheduledBatch([], [])
        if seq.status is SequenceStatus.WAITING:
            if not seq.block_table and not seq.skips_prefix_cache:
                self.blocks.match_prefix(seq)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        n = seq.num_uncomputed_tokens
        if self.config.chunked_prefill:
            n = min(n, self.config.max_batch_prefill_tokens)
        if self._reserve(seq, n, [s for s in self.running if s is not seq]):
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
        return batch

    def _may_join(self, batch_running: bool) -> bool:
        """TGI's rule, when prompts are not chunked: new requests join a running batch
        once enough are waiting (waiting_served_ratio) or it has waited long enough
        (max_waiting_tokens decode steps)."""
        if self.config.chunked_prefill or not batch_running:
            return True
        if self.steps_since_join >= self.config.max_waiting_tokens:
            return True
        room = self.config.max_batch_size - len(self.running)
        wanted = int(len(self.running) * self.config.waiting_served_ratio)
        return min(len(self.waiting), room) >= max(wanted, 1)

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        queue = list(self.running)
        while queue:
            seq = queue.pop(0)
            n = seq.num_uncomputed_tokens
            if n > 1:  # still prefilling: a chunk within the budget
                n = min(n, budget)
                if n == 0:
                    continue
            if not self._reserve(seq, n, queue):
                continue  # seq itself was preempted
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            if seq.num_uncomputed_tokens > 1:
                budget -= n
        return budget

    def _reserve(self, seq: Sequence, n: int, queue: list[Sequence]) -> bool:
        """Find blocks for n more tokens of seq, preempting the youngest others if needed."""
        # Recomputed after each preemption: a preempted sibling may leave seq the only holder
        # of a shared block, and then it writes in place instead of copying.
        while not self.blocks.can_allocate(
            self.blocks.blocks_needed(seq, seq.num_computed_tokens + n)
        ):
            victim = queue.pop() if queue else seq
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq, seq.num_computed_tokens + n)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        joined = 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_batch_size:
            seq = self.waiting[0]
            # Its choices fork into the batch later: admit them only when they all fit (a
            # request with more choices than max_batch_size runs alone).
            if self.running and self._width() + 1 + len(seq.unforked) > (
                self.config.max_batch_size
            ):
                break
            if not seq.block_table and not seq.skips_prefix_cache:
                self.blocks.match_prefix(seq)
            n = seq.num_uncomputed_tokens
            if self.config.chunked_prefill:
                n = min(n, budget)
            # Unchunked, one prompt may exceed the budget alone (a preempted sequence
            # resumes with prompt + output), else it could never run.
            over_budget = n > budget and budget < self.config.max_batch_prefill_tokens
            needed = self.blocks.blocks_needed(seq, seq.num_computed_tokens + n)
            if over_budget or not self.blocks.can_allocate(needed):
                self.blocks.free(seq)  # give back prefix hits; they stay cached
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            self.blocks.allocate(seq, seq.num_computed_tokens + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            joined += 1
        return joined

    def _width(self) -> int:
        """Running sequences, counting the choices they will fork into."""
        return sum(1 + len(seq.unforked) for seq in self.running)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` from where the running `parent` is, sharing its KV blocks. Admission
        counted the children in, so only a request with more choices than max_batch_size
        makes the batch exceed it (alone, for its lifetime)."""
        self.blocks.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def postprocess(self, batch: ScheduledBatch) -> None:
        """Advance computed-token counts once the step has run."""
        for seq, n in zip(batch.seqs, batch.num_tokens, strict=True):
            seq.num_computed_tokens += n

    def finish(self, seq: Sequence, reason: str, *, forget_blocks: bool = False) -> None:
        """Mark seq finished (also for aborts) and give its blocks back."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if any(s is seq for s in self.solo):  # else held until the next schedule()
            self.solo.remove(seq)
        self.blocks.free(seq, forget=forget_blocks)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
