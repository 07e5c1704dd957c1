"""The transformers backend splits a thinking model's reasoning as the native engine does
(the same splitter, fed by its request tracker), on the hand-set thinking model."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from backends.base import GenerationEvent, GenerationRequest, SamplingParams
from backends.transformers.backend import TransformersBackend
from backends.transformers.options import TransformersOptions
from tests.gateway.thinking_model import (
    CONTENT,
    REASONING,
    REASONING_TOKENS,
    write_thinking_model,
)

GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
) -> AsyncIterator[TransformersBackend]:
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir)
    started = TransformersBackend(str(folder), TransformersOptions(dtype="float32",
                                                                   max_total_tokens=256),
                                  served_name="thinker")
    await started.start()
    yield started
    await started.close()


async def _events(backend: TransformersBackend, req: GenerationRequest,
                  ) -> list[GenerationEvent]:
    return [event async for event in backend.generate(req)]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("kwargs", "reasoning_tokens"),
                         [(None, REASONING_TOKENS), ({"think_in_prompt": True},
                                                     REASONING_TOKENS - 1)])
async def test_events_carry_the_split_and_the_reasoning_tokens(
    backend: TransformersBackend, kwargs: dict[str, bool] | None, reasoning_tokens: int,
) -> None:
    req = GenerationRequest("r", GREEDY, messages=MESSAGES, chat_template_kwargs=kwargs)
    events = await _events(backend, req)
    splits = [e.split for e in events if e.split is not None]
    assert len(splits) == len(events)
    assert "".join(s.reasoning for s in splits) == REASONING
    assert "".join(s.content for s in splits) == CONTENT
    assert "".join(e.text for e in events).endswith(f"{REASONING}</think>{CONTENT}")
    usage = events[-1].usage
    assert usage is not None and usage.reasoning_tokens == reasoning_tokens
