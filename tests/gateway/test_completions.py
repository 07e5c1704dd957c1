"""/v1/completions through the openai SDK."""

from __future__ import annotations

import openai

from tests.gateway.echo_backend import EchoBackend


def test_non_stream_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(model="echo", prompt="one two three", max_tokens=3)
    assert out.id.startswith("cmpl-")
    assert out.object == "text_completion"
    assert out.model == "echo"
    choice = out.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, "alpha beta gamma", "length")
    assert choice.logprobs is None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        3, 3, 6)


def test_stream_equals_non_stream(client: openai.OpenAI) -> None:
    whole = client.completions.create(model="echo", prompt="hi there")
    chunks = list(client.completions.create(model="echo", prompt="hi there", stream=True))
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].choices[0].text == ""
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.completions.create(
        model="echo", prompt="a b", max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.total_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_token_id_prompt(client: openai.OpenAI, echo_backends: dict[str, EchoBackend]) -> None:
    out = client.completions.create(model="echo", prompt=[5, 6, 7, 8], max_tokens=1)
    assert out.usage.prompt_tokens == 4
    req = echo_backends["echo"].requests[-1]
    assert req.prompt_token_ids == [5, 6, 7, 8]


def test_batch_of_one_is_unwrapped(client: openai.OpenAI) -> None:
    out = client.completions.create(model="echo", prompt=["x y"], max_tokens=1)
    assert out.usage.prompt_tokens == 2


def test_logprobs_zero(client: openai.OpenAI) -> None:
    out = client.completions.create(model="echo", prompt="x", max_tokens=3, logprobs=0)
    lp = out.choices[0].logprobs
    assert lp.tokens == ["alpha", " beta", " gamma"]
    assert lp.token_logprobs == [-0.5, -0.5, -0.5]
    assert lp.text_offset == [0, 5, 10]
