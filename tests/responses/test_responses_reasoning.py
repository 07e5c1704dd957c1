"""A thinking model's reasoning as `reasoning` output items, whole and streamed, and carried
back into the conversation by `previous_response_id`.

The model (tests/gateway/thinking_model.py) is a hand-set tiny Llama whose greedy output is
`<think>So ok</think>Hello world`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.thinking_model import CONTENT, REASONING, REASONING_TOKENS, write_thinking_model
from tests.responses.conftest import sdk

MODEL = "thinker"


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           ) -> Iterator[openai.OpenAI]:
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir)
    config = EngineConfig(model=str(folder), served_model_name=MODEL, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
                          compile=False)
    settings = Settings(model_id="unused", cache_dir=str(tmp_path_factory.mktemp("cache")))
    app = create_app(settings, backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=300) as url:
        yield sdk(url)


def test_the_reasoning_is_an_item_before_the_message(client: openai.OpenAI) -> None:
    answer = client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                     max_output_tokens=20)
    reasoning, message = answer.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [c.text for c in reasoning.content] == [REASONING] and reasoning.summary == []
    assert message.type == "message" and answer.output_text == CONTENT
    assert answer.status == "completed"
    assert answer.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_stream_sends_reasoning_events_then_the_answers(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                          max_output_tokens=20, stream=True))
    kinds = [e.type for e in events]
    first_text = kinds.index("response.output_text.delta")
    assert kinds.index("response.reasoning_text.done") < first_text
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    content = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, content) == (REASONING, CONTENT)
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in final.output] == ["reasoning", "message"]


def test_a_continued_conversation_gives_the_reasoning_back_as_chat_does(
        client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Say hello.", temperature=0,
                                    max_output_tokens=20)
    second = client.responses.create(model=MODEL, previous_response_id=first.id,
                                     input="Again.", temperature=0, max_output_tokens=20)
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, messages=[
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING},
        {"role": "user", "content": "Again."}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
