"""A client that leaves before its first token still pays for its prompt: the prompt was
queued and prefilled for it. A real server, real Redis; the model answers its first token
only after 5 s, so the client (gone after 0.5 s) leaves before it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import ADMIN_KEY, RedisServer, create_key
from tests.auth.test_replicas import model_usage, usage, wait_until
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

LATE = "late"
PROMPT = "one two three four five"  # the echo backend counts words: 5 prompt tokens


@pytest.fixture(scope="module")
def url(redis_server: RedisServer) -> Iterator[str]:
    late = EchoBackend(name=LATE, max_total_tokens=1000, delay_s=5.0)
    settings = Settings(model_id="unused", redis_url=redis_server.url, admin_key=ADMIN_KEY)
    with running_server(create_app(settings, backends={LATE: late})) as base:
        yield base


@pytest.mark.parametrize("streamed", [True, False])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_client_gone_before_the_first_token_is_billed_its_prompt(
    url: str, streamed: bool, path: str,
) -> None:
    made = create_key(url, name="prefill", budget=10_000, parallel=2)
    body = {"model": LATE, "max_tokens": 4, "stream": streamed,
            **({"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path
               else {"prompt": PROMPT})}
    with pytest.raises(httpx.ReadTimeout):  # no byte comes before the first token
        httpx.post(f"{url}{path}", json=body, timeout=httpx.Timeout(10, read=0.5),
                   headers={"Authorization": f"Bearer {made['key']}"})
    wait_until(lambda: model_usage(url, made["id"], LATE)["prompt_tokens"] > 0)
    row = model_usage(url, made["id"], LATE)
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (1, 5, 0)
    assert usage(url, made["id"])["budget"]["used"] == 5  # the reservation settled to the prompt
