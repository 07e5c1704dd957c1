"""A Backend that says a scripted text, piece by piece, for gateway tests (no model, no torch).

Every choice says the same pieces (one token each), the choices' events in round-robin;
each token of choice k has logprob `logprob_of(k)`, so `best_of` has something to rank.
It reports a chat template (so the tool planner can pick a parser) and records every request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from backends.base import (
    BackendStats,
    GenerationEvent,
    GenerationRequest,
    Health,
    ModelInfo,
    TokenInfo,
    Usage,
)

# Enough of Qwen 2.5's template for a planner to see Hermes-style <tool_call> support.
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}"
    "{{- tool | tojson }}{%- endfor %}{{- '</tools>\\nFor each function call, return a json "
    "object within <tool_call></tool_call> XML tags<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.tool_calls %}{%- for tool_call in "
    "message.tool_calls %}{{- '<tool_call>\\n' }}{{- tool_call.function | tojson }}"
    "{{- '\\n</tool_call>' }}{%- endfor %}{%- elif message.role == 'tool' %}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>' }}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def default_logprob(choice: int) -> float:
    return -0.1 * (choice + 1)


@dataclass
class ScriptedBackend:
    pieces: Sequence[str]
    name: str = "scripted"
    chat_template: str | None = HERMES_TEMPLATE
    logprob_of: Callable[[int], float] = default_logprob
    requests: list[GenerationRequest] = field(default_factory=list)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def health(self) -> Health:
        return Health(ready=True)

    def info(self) -> ModelInfo:
        return ModelInfo(name=self.name, max_input_tokens=4095, max_total_tokens=4096,
                         backend="scripted", chat_template=self.chat_template)

    def stats(self) -> BackendStats:
        return BackendStats()

    def drain_step_timings(self) -> list:
        return []

    def count_tokens(self, req: GenerationRequest) -> int:
        return 5

    def tokenize(self, req: GenerationRequest) -> list[int]:
        return [1, 2, 3, 4, 5]

    def detokenize(self, token_ids: list[int]) -> str:
        return "".join(self.pieces[t % len(self.pieces)] for t in token_ids)

    def generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.requests.append(req)
        return self._generate(req)

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        n, last = req.sampling.n, len(self.pieces) - 1
        for i, piece in enumerate(self.pieces):
            for k in range(n):
                token = TokenInfo(id=i, text=piece, logprob=self.logprob_of(k))
                done = i == last
                yield GenerationEvent(
                    text=piece, tokens=(token,), index=k,
                    finish_reason="stop" if done else None,
                    usage=Usage(5, len(self.pieces)) if done else None)
