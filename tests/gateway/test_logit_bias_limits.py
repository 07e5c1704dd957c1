"""How many token ids a request may name (gateway/openai/requests.py): logit_bias over the
whole vocabulary with n=16 once took another client's stream from 8 ms to 555 ms between
tokens; past MAX_LOGIT_BIAS entries (or MAX_STOP_TOKEN_IDS stop ids) it is a 400 naming
the field, over a real server and the openai SDK."""

from __future__ import annotations

import openai
import pytest

from gateway.app import create_app
from gateway.openai.requests import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.echo_backend import EchoBackend

VOCAB = 49152  # the default model's
MESSAGES = [{"role": "user", "content": "hello there"}]


@pytest.fixture
def client(serve_app: ServeApp) -> openai.OpenAI:
    url = serve_app(create_app(Settings(), backends={"echo": EchoBackend(name="echo")}))
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def _refused(client: openai.OpenAI, param: str, **fields: object) -> str:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=2,
                                       **fields)  # type: ignore[call-overload]
    assert caught.value.param == param and caught.value.code == "invalid_value", \
        caught.value.body
    return caught.value.message


def test_logit_bias_over_the_whole_vocabulary_with_n_16_is_refused(
        client: openai.OpenAI) -> None:
    everything = {str(token): -1.0 for token in range(VOCAB)}
    message = _refused(client, "logit_bias", logit_bias=everything, n=16)
    assert f"{VOCAB} entries" in message and f"at most {MAX_LOGIT_BIAS}" in message
    _refused(client, "logit_bias", logit_bias={str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)})
    at_limit = {str(token): -1.0 for token in range(MAX_LOGIT_BIAS)}
    reply = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=2, n=16,
                                           logit_bias=at_limit)  # type: ignore[arg-type]
    assert len(reply.choices) == 16


def test_stop_token_ids_over_the_limit_are_refused(client: openai.OpenAI) -> None:
    everything = list(range(VOCAB))
    message = _refused(client, "stop_token_ids", extra_body={
        "stop_token_ids": everything, "min_tokens": 1})
    assert f"at most {MAX_STOP_TOKEN_IDS}" in message
    reply = client.chat.completions.create(model="echo", messages=MESSAGES, max_tokens=2,
                                           extra_body={"stop_token_ids": everything[:1024]})
    assert reply.choices[0].message.content
