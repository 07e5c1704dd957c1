"""A generation that fails after its stream started: an `error` event, then `response.failed`,
and nothing stored. The echo backend (tests/gateway/echo_backend.py) fails on cue after two
tokens, which no real model does on demand."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend
from tests.responses.conftest import sdk


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    settings = Settings(cache_dir=str(tmp_path_factory.mktemp("cache")))
    with running_server(create_app(settings, backends={"echo": EchoBackend(name="echo")})) as url:
        yield sdk(url)


@pytest.mark.parametrize(("prompt", "code"), [("FAIL_MIDWAY please", "internal_error"),
                                            ("ABORT_NOW", "request_aborted")])
def test_a_failure_after_the_start_is_an_error_event_then_response_failed(
        client: openai.OpenAI, prompt: str, code: str) -> None:
    events = list(client.responses.create(model="echo", input=prompt, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-2:] == ["error", "response.failed"]
    error, failed = events[-2], events[-1]
    assert error.code == code and error.message
    assert failed.response.status == "failed" and failed.response.error.code == "server_error"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.response.id)


@pytest.mark.parametrize(("prompt", "status"), [("FAIL_MIDWAY please", 500),
                                                ("ABORT_NOW", 503)])
def test_a_whole_answer_that_fails_is_the_status(client: openai.OpenAI, prompt: str,
                                                 status: int) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model="echo", input=prompt)
    assert caught.value.status_code == status
