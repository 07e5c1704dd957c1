"""/tokenize and /detokenize (vLLM's shapes) over a real native model behind a real server,
checked against transformers' tokenizer and the server's own usage counts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp, running_server
from tests.gateway.echo_backend import EchoBackend

MODEL = "tiny-llama"
PROMPT = "Once upon a time, a brave little toaster"
ADMIN_SECRET = "sy-admin-" + "s3cr3t" * 6  # the server refuses admin keys under 32 characters
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model: Callable[[str], Path]) -> Path:
    return tiny_model("llama_gqa")


@pytest.fixture(scope="module")
def base_url(model_dir: Path) -> Iterator[str]:
    config = EngineConfig(model=str(model_dir), served_model_name=MODEL, dtype="float32",
                          max_total_tokens=256, max_batch_total_tokens=1024, block_size=8)
    app = create_app(Settings(model_id="unused"), backends={MODEL: NativeBackend(config)})
    with running_server(app, timeout_s=120) as url:
        yield url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=30) as session:
        yield session


def test_tokenize_prompt_matches_transformers_and_usage(
    http: httpx.Client, base_url: str, model_dir: Path,
) -> None:
    answer = http.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert set(answer) == {"count", "max_model_len", "tokens"}
    reference = AutoTokenizer.from_pretrained(model_dir)(PROMPT).input_ids
    assert answer["tokens"] == reference
    assert (answer["count"], answer["max_model_len"]) == (len(reference), 256)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    assert out.usage.prompt_tokens == answer["count"]


def test_detokenize_round_trip(http: httpx.Client, model_dir: Path) -> None:
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]  # sole model
    text = http.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()
    reference = AutoTokenizer.from_pretrained(model_dir).decode(tokens)
    assert text == {"prompt": reference}
    assert text["prompt"].endswith(PROMPT)
    assert http.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenize_messages_counts_like_a_chat_request(http: httpx.Client, base_url: str) -> None:
    answer = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="k", max_retries=0)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                         temperature=0)
    assert answer["count"] == out.usage.prompt_tokens == len(answer["tokens"])
    bare = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES,
                                        "add_generation_prompt": False}).json()
    assert bare["count"] < answer["count"]
    assert answer["tokens"][:bare["count"]] == bare["tokens"]


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"model": MODEL}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": "x", "messages": MESSAGES}, 400, None),
    ("/tokenize", {"model": MODEL, "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
    ("/tokenize", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"model": MODEL}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"model": MODEL, "tokens": ["a"]}, 400, "tokens[0]"),
    ("/detokenize", {"model": MODEL, "tokens": [10**6]}, 400, "tokens"),
])
def test_bad_requests(http: httpx.Client, path: str, body: dict, status: int,
                      param: str | None) -> None:
    response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if param is None:
        assert "prompt or messages" in error["message"]


def test_guarded_like_the_generation_routes(serve_app: ServeApp) -> None:
    url = serve_app(create_app(Settings(admin_key=ADMIN_SECRET),
                               backends={"echo": EchoBackend()}))
    for path, body in (("/tokenize", {"prompt": "a b"}), ("/detokenize", {"tokens": [1]})):
        assert httpx.post(f"{url}{path}", json=body).status_code == 401
        response = httpx.post(f"{url}{path}", json=body,
                              headers={"Authorization": f"Bearer {ADMIN_SECRET}"})
        assert response.status_code != 401
    detok = httpx.post(f"{url}/detokenize", json={"tokens": [1, 2]},
                       headers={"Authorization": f"Bearer {ADMIN_SECRET}"})
    assert detok.json() == {"prompt": "beta gamma"}
