"""A thinking model's reasoning through Ollama's API: `message.thinking` (and /api/generate's
`thinking`), streamed and whole, and `think: false` (tests/gateway/thinking_model.py: a
hand-set tiny Llama whose greedy output is `<think>So ok</think>Hello world`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import ollama
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.thinking_model import CONTENT, NO_THINKING, REASONING, write_thinking_model

MODEL = "thinker"
MESSAGES = [{"role": "user", "content": "Say hello."}]
GREEDY = {"temperature": 0, "num_predict": 20}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path,
           ) -> Iterator[ollama.Client]:
    folder = write_thinking_model(tmp_path_factory.mktemp("thinker"), tokenizer_dir)
    config = EngineConfig(model=str(folder), served_model_name=MODEL, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=2048, block_size=8,
                          compile=False)
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=600) as url:
        yield ollama.Client(host=url, timeout=120)


def test_the_reasoning_is_answered_as_thinking(client) -> None:
    for think in (None, True, "high"):
        answer = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, think=think)
        assert (answer.message.thinking, answer.message.content) == (REASONING, CONTENT)
        assert answer.done_reason == "stop"
    generated = client.generate(model=MODEL, prompt="Say hello.", options=GREEDY)
    assert (generated.thinking, generated.response) == (REASONING, CONTENT)


def test_streamed_thinking_comes_before_the_content(client) -> None:
    parts = list(client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == REASONING
    assert "".join(p.message.content or "" for p in parts) == CONTENT
    first_content = next(i for i, p in enumerate(parts) if p.message.content)
    assert not any(p.message.thinking for p in parts[first_content:])


def test_think_false_reaches_the_template(client) -> None:
    answer = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY, think=False)
    assert (answer.message.thinking, answer.message.content) == (None, NO_THINKING)
    assert "thinking" in client.show(MODEL).capabilities


def test_thinking_in_the_history_is_accepted(client) -> None:
    first = client.chat(model=MODEL, messages=MESSAGES, options=GREEDY)
    history = [*MESSAGES, first.message, {"role": "user", "content": "Again."}]
    again = client.chat(model=MODEL, messages=history, options=GREEDY)
    assert again.message.content == CONTENT
    assert again.prompt_eval_count > first.prompt_eval_count
