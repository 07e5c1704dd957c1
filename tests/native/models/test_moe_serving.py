"""A mixture-of-experts model served over HTTP: /info reports the experts' share of the
weights, and /metrics the tokens routed to each expert, summed over the MoE layers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from backends.native.backend import NativeBackend
from backends.native.config import EngineConfig
from gateway.app import create_app
from gateway.settings import Settings
from tests.gateway.conftest import running_server
from tests.gateway.test_metrics import sample
from tests.gateway.test_sampling_defaults import _wait_ready
from tests.native.models.moe_tiny import EXPERT_SIZE, moe_tweak, qwen3_moe_config
from tests.native.models.tiny import write_tiny

PROMPT = [5, 9, 300, 41, 7, 1000, 12]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Iterator[str]:
    folder = write_tiny(tmp_path_factory.mktemp("moe-serving"), tokenizer_dir,
                        qwen3_moe_config(), tweak=moe_tweak)
    backend = NativeBackend(EngineConfig(model=str(folder), served_model_name="moe",
                                         dtype="float32", max_total_tokens=64, compile=False))
    # The model loads in uvicorn's startup (the lifespan).
    with running_server(create_app(Settings(), backends={"moe": backend}),
                        timeout_s=120) as base:
        _wait_ready(base)
        yield base


def test_info_reports_the_experts_bytes(url: str) -> None:
    extra = httpx.get(f"{url}/info").json()
    config = qwen3_moe_config()
    # One sparse layer (layer 0 is dense): 8 experts of gate, up and down, float32.
    experts = config.num_experts * 3 * config.hidden_size * EXPERT_SIZE * 4
    assert extra["expert_bytes"] == experts
    assert extra["weight_bytes"] > experts


def test_metrics_count_the_tokens_routed_to_each_expert(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    done = client.completions.create(model="moe", prompt=PROMPT, max_tokens=NEW_TOKENS,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == NEW_TOKENS
    text = httpx.get(f"{url}/metrics").text
    config = qwen3_moe_config()
    routed = [sample(text, "switchyard_moe_expert_tokens_total", model="moe", expert=str(e))
              for e in range(config.num_experts)]
    # Every prompt token and every generated token but the last passes the one MoE layer,
    # each routed to top_k experts.
    fed = len(PROMPT) + NEW_TOKENS - 1
    assert sum(routed) == config.num_experts_per_tok * fed
    assert max(routed) <= fed  # a token picks an expert at most once
