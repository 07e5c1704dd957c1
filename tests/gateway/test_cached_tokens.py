"""usage.prompt_tokens_details.cached_tokens: the prompt tokens the native engine's prefix cache
served, through a real uvicorn server and the real openai SDK."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server

MODEL = "tiny-llama"
BLOCK = 8
# Long enough for several KV blocks; each test starts from its own, so its first request misses.
PREFIX = ("You are a careful assistant for the lighthouse keepers' guild. Answer briefly, "
          "name the tide tables you used, and never invent a harbour. ")


@pytest.fixture(scope="module")
def base_url(tiny_model: Callable[[str], Path]) -> Iterator[str]:
    config = EngineConfig(
        model=str(tiny_model("llama_gqa")), served_model_name=MODEL, dtype="float32",
        max_total_tokens=256, max_batch_total_tokens=2048, block_size=BLOCK, compile=False,
    )
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def _tokens(base_url: str, body: dict[str, Any]) -> list[int]:
    answer = httpx.post(f"{base_url}/tokenize", json={"model": MODEL, **body}, timeout=30)
    answer.raise_for_status()
    return answer.json()["tokens"]


def _expected_hit(first: list[int], second: list[int]) -> int:
    """Full blocks of the shared prefix; the last prompt token is always computed."""
    shared = 0
    while shared < min(len(first), len(second)) and first[shared] == second[shared]:
        shared += 1
    return min(shared, len(second) - 1) // BLOCK * BLOCK


def _chat(seed: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"[{seed}] {PREFIX}"},
            {"role": "user", "content": question}]


def test_chat_reports_the_prefix_cache_hit(client: openai.OpenAI, base_url: str) -> None:
    first_messages = _chat("chat", "When is high tide at Penzance?")
    second_messages = _chat("chat", "Which lamp oil lasts longest?")
    first = client.chat.completions.create(model=MODEL, messages=first_messages,
                                           max_tokens=4, temperature=0)
    second = client.chat.completions.create(model=MODEL, messages=second_messages,
                                            max_tokens=4, temperature=0)
    expected = _expected_hit(_tokens(base_url, {"messages": first_messages}),
                             _tokens(base_url, {"messages": second_messages}))
    assert expected >= 3 * BLOCK  # the test needs a prefix of several blocks
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == expected
    assert cached % BLOCK == 0 and 0 < cached <= second.usage.prompt_tokens


def test_the_streamed_usage_chunk_reports_it_too(client: openai.OpenAI) -> None:
    messages = _chat("stream", "How many steps has the tower?")
    runs = []
    for _ in range(2):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        runs.append(chunks[-1].usage)
    assert runs[0].prompt_tokens_details.cached_tokens == 0
    # The same prompt again: every full block but the one holding its last token.
    expected = (runs[1].prompt_tokens - 1) // BLOCK * BLOCK
    assert runs[1].prompt_tokens_details.cached_tokens == expected > 0


def test_completions_report_it(client: openai.OpenAI, base_url: str) -> None:
    first_prompt, second_prompt = f"[text] {PREFIX} Tide: ", f"[text] {PREFIX} Lamp: "
    first = client.completions.create(model=MODEL, prompt=first_prompt, max_tokens=4,
                                      temperature=0)
    second = client.completions.create(model=MODEL, prompt=second_prompt, max_tokens=4,
                                       temperature=0)
    expected = _expected_hit(_tokens(base_url, {"prompt": first_prompt}),
                             _tokens(base_url, {"prompt": second_prompt}))
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected >= 3 * BLOCK


def test_n_choices_count_the_shared_prompt_once(client: openai.OpenAI) -> None:
    messages = _chat("n", "Name two harbours.")
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           temperature=0, n=3)
    expected = (again.usage.prompt_tokens - 1) // BLOCK * BLOCK
    assert again.usage.prompt_tokens_details.cached_tokens == expected > 0
