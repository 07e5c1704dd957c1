"""Hostile JSON bodies against a real server: nesting deep enough to exhaust any recursion is
a 400 naming the limit (never a 500), and many large bodies at once are parsed one at a time,
so the server's memory stays bounded (gateway/body.py, gateway/json_depth.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.app import create_app
from gateway.body import lone_surrogate
from gateway.json_depth import MAX_JSON_DEPTH, nesting_depth
from gateway.settings import Settings
from tests.gateway.conftest import ServeApp
from tests.gateway.drain_server import GatewayProcess
from tests.gateway.scripted_backend import ScriptedBackend

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
MIB = 1024**2


def _nested_schema(levels: int) -> dict[str, object]:
    schema: dict[str, object] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def _tool(parameters: dict[str, object]) -> dict[str, object]:
    return {"type": "function", "function": {"name": "deep", "parameters": parameters}}


@pytest.fixture
def url(serve_app: ServeApp) -> str:
    return serve_app(create_app(Settings(), backends={"scripted": ScriptedBackend(["ok"])}))


def _refused_as_too_deep(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_json" and f"more than {MAX_JSON_DEPTH} levels" in \
        error["message"]


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
def test_a_400_level_nested_tool_schema_is_a_400(url: str, tool_choice: str) -> None:
    body = {"model": "scripted", "messages": MESSAGES, "tools": [_tool(_nested_schema(400))],
            "tool_choice": tool_choice}
    _refused_as_too_deep(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30))
    # A schema nested as deep as the limit allows is served.
    body["tools"] = [_tool(_nested_schema(MAX_JSON_DEPTH // 2 - 4))]
    assert httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/generate"])
@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 900, 100_000])
def test_deeply_nested_arrays_are_a_400(url: str, path: str, levels: int) -> None:
    deep = "[" * levels + "]" * levels
    raw = ('{"model": "scripted", "prompt": ' + deep + ', "messages": ' + deep +
           ', "inputs": ' + deep + "}")
    answer = httpx.post(f"{url}{path}", content=raw.encode(), timeout=30,
                        headers={"content-type": "application/json"})
    if path == "/generate":  # TGI's routes answer every input problem with 422
        assert answer.status_code == 422 and "more than" in answer.json()["error"]
    else:
        _refused_as_too_deep(answer)


def test_depth_ignores_brackets_in_strings() -> None:
    assert nesting_depth(b'{"a": "[[[{{\\"[[", "b": [[1], {"c": []}]}') == 4
    assert nesting_depth(b"[]") == 1 and nesting_depth(b"12") == 0
    deep = "[" * 200 + "]" * 200
    assert nesting_depth(json.dumps({"x": deep}).encode()) == 1


def test_lone_surrogate_walk_names_where() -> None:
    data = {"a": [1, {"b": "ok", "c": ["x", "\ud800"]}]}
    assert lone_surrogate(data) == ("a", 1, "c", 1)
    assert lone_surrogate({"a": [{"\udc00": 1}]}) == ("a", 0)
    assert lone_surrogate({"a": [[[]]], "b": "fine"}) is None and lone_surrogate("\ud800") == ()


def _peak_rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmHWM")


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[GatewayProcess]:
    process = GatewayProcess.start(tmp_path, {})
    yield process
    process.stop()


def test_forty_parallel_8_mib_bodies_leave_memory_bounded(gateway: GatewayProcess) -> None:
    """`[{},{},...]` takes ~25x its size parsed (8 MiB: ~200 MiB). Held and expanded all at
    once, forty would take gigabytes; the bound is the forty raw bodies alone (320 MiB):
    the server holds one such body at a time, in all ~26x its size."""
    body = b"[" + b"{}," * (8 * MIB // 3 - 2) + b"{}]"
    before = _peak_rss_mib(gateway.proc.pid)

    async def send_all() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            return await asyncio.gather(*[
                http.post(f"{gateway.url}/v1/chat/completions", content=body,
                          headers={"content-type": "application/json"}) for _ in range(40)])

    answers = asyncio.run(send_all())
    assert {a.status_code for a in answers} == {400}
    assert answers[0].json()["error"]["code"] == "invalid_type"
    growth = _peak_rss_mib(gateway.proc.pid) - before
    assert growth < 40 * 8, f"peak RSS grew {growth} MiB"
    assert httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": "echo", "messages": MESSAGES, "max_tokens": 2}).status_code == 200
