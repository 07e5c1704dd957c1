"""A thinking model's reasoning through Anthropic's Messages API: `thinking` blocks and
`thinking_delta` events (tests/gateway/thinking_model.py: a hand-set tiny Llama whose greedy
output is `<think>So ok</think>Hello world`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.thinking_model import (
    CONTENT,
    NO_THINKING,
    REASONING,
    REASONING_TOKENS,
    write_thinking_model,
)

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Say hello."}]
GREEDY = {"extra_body": {"temperature": 0}}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           ) -> Iterator[anthropic.Anthropic]:
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir)
    config = EngineConfig(model=str(folder), served_model_name=MODEL, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
                          compile=False)
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=600) as url:
        yield anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=120)


def _create(client: anthropic.Anthropic, **extra: Any) -> anthropic.types.Message:
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "messages": MESSAGES, **GREEDY,
                           **extra}
    return client.messages.create(**ask)


def test_the_reasoning_is_a_thinking_block_before_the_text(client) -> None:
    message = _create(client, thinking={"type": "enabled", "budget_tokens": 1024})
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text"]
    assert message.content[0].thinking == REASONING and message.content[1].text == CONTENT
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens >= REASONING_TOKENS + 2


def test_streamed_thinking_deltas_build_the_same_message(client) -> None:
    deltas: list[str] = []
    with client.messages.stream(model=MODEL, max_tokens=20, messages=MESSAGES,
                                **GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                deltas.append(event.delta.thinking)
        final = stream.get_final_message()
    assert "".join(deltas) == REASONING
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING and final.content[1].text == CONTENT


def test_thinking_disabled_reaches_the_template(client) -> None:
    message = _create(client, thinking={"type": "disabled"})
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == NO_THINKING


def test_a_thinking_block_in_the_history_is_accepted(client) -> None:
    first = _create(client)
    history = [*MESSAGES, {"role": "assistant", "content": first.content},
               {"role": "user", "content": "Again."}]
    again = _create(client, messages=history)
    assert again.content[-1].text == CONTENT
