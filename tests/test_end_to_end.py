"""End to end: the default model, served as `switchyard serve` would, answers through the SDK."""

from __future__ import annotations

import openai

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server


def test_default_model_knows_the_capital_of_france() -> None:
    settings = Settings(model_id="default", max_total_tokens=1024, kv_cache_memory=256 * 2**20)
    with running_server(create_app(settings), timeout_s=300) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        answer = client.chat.completions.create(
            model=model.id, temperature=0, max_tokens=40,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
        )
    assert "Paris" in answer.choices[0].message.content
