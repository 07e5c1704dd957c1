"""`switchyard serve --log-format json` with API keys on (a real Redis): every line is JSON,
each request has one access line with its facts (never the key), /health polls have none,
and while the model loads /health and /info name the load stage (weights read slowly here:
SWITCHYARD_TEST_WEIGHT_DELAY_S)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.auth.conftest import ADMIN_KEY, REPO, RedisServer, free_port
from tests.kernel_cache import seed_kernels

MODEL = "tiny"
WRONG_KEY = "sk-sy-" + "x" * 40
BASE_FIELDS = ("timestamp", "level", "logger", "message")
ACCESS_FIELDS = ("request_id", "key_id", "model", "deployment", "status", "prompt_tokens",
                 "completion_tokens", "queue_s", "ttft_s", "total_s")


@dataclass
class Run:
    """What one server run left: its output lines, the key, what loading looked like."""

    stdout: str = ""
    stderr: str = ""
    secret: str = ""
    key_id: str = ""
    loading_health: list[dict[str, Any]] = field(default_factory=list)
    loading_info: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    request_ids: dict[str, str] = field(default_factory=dict)  # route -> x-request-id

    def lines(self) -> list[str]:
        return [line for line in (self.stdout + self.stderr).splitlines() if line.strip()]

    def records(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.lines()]

    def access(self) -> list[dict[str, Any]]:
        return [r for r in self.records() if r.get("access")]


def _poll_while_loading(url: str, process: subprocess.Popen, run: Run) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            health = httpx.get(f"{url}/health", timeout=5,  # the detail: the admin's
                               headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if health.status_code == 200:
            return
        run.loading_health.append(health.json())
        info = httpx.get(f"{url}/info", timeout=5)
        run.loading_info.append((info.status_code, info.json()))
        time.sleep(0.05)
    raise AssertionError(f"not ready: {run.loading_health[-1:]}")


def _requests(url: str, run: Run) -> None:
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    made = httpx.post(f"{url}/admin/keys", json={"name": "logs"}, headers=admin).json()
    run.secret, run.key_id = made["key"], made["id"]
    auth = {"Authorization": f"Bearer {run.secret}", "x-request-id": "client-chosen-1"}
    chat = httpx.post(f"{url}/v1/chat/completions", headers=auth, timeout=60, json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    run.request_ids["chat"] = chat.headers["x-request-id"]
    auth.pop("x-request-id")
    with httpx.stream("POST", f"{url}/v1/completions", headers=auth, timeout=60, json={
            "model": MODEL, "prompt": "once upon", "max_tokens": 5, "stream": True}) as streamed:
        assert streamed.status_code == 200
        run.request_ids["stream"] = streamed.headers["x-request-id"]
        assert "[DONE]" in "".join(streamed.iter_text())
    tgi = httpx.post(f"{url}/generate", headers=auth, timeout=60, json={
        "inputs": "hello", "parameters": {"max_new_tokens": 3}})
    assert tgi.status_code == 200, tgi.text
    run.request_ids["tgi"] = tgi.headers["x-request-id"]
    wrong = httpx.post(f"{url}/v1/chat/completions", headers={
        "Authorization": f"Bearer {WRONG_KEY}"}, json={"model": MODEL, "messages": []})
    assert wrong.status_code == 401
    for _ in range(5):
        assert httpx.get(f"{url}/health").status_code == 200
    httpx.get(f"{url}/metrics")
    run.info = httpx.get(f"{url}/info").json()


@pytest.fixture(scope="module")
def run(redis_server: RedisServer, tiny_model: Callable[[str], Path],
        tmp_path_factory: pytest.TempPathFactory) -> Run:
    folder = tmp_path_factory.mktemp("json-logs")
    seed_kernels(folder / "cache")
    port = free_port()
    env = {**os.environ, "SWITCHYARD_REDIS_URL": redis_server.url,
           "SWITCHYARD_ADMIN_KEY": ADMIN_KEY, "SWITCHYARD_LOG_FORMAT": "json",
           "SWITCHYARD_CACHE_DIR": str(folder / "cache"),
           "SWITCHYARD_TEST_WEIGHT_DELAY_S": "0.15", "OMP_NUM_THREADS": "1"}
    model = str(tiny_model("llama_gqa"))
    argv = [sys.executable, "-m", "gateway.cli", "serve", "--model-id", model,
            "--served-model-name", MODEL, "--port", str(port), "--dtype", "float32",
            "--max-total-tokens", "256", "--kv-cache-memory", "16MiB", "--num-threads", "1",
            "--compile", "false"]
    out, err = folder / "stdout.log", folder / "stderr.log"
    result = Run()
    with open(out, "wb") as stdout, open(err, "wb") as stderr:
        process = subprocess.Popen(argv, cwd=REPO, env=env, stdout=stdout, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        _poll_while_loading(url, process, result)
        _requests(url, result)
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=60)
    result.stdout, result.stderr = out.read_text(), err.read_text()
    return result


def test_every_line_is_json_with_the_base_fields(run: Run) -> None:
    assert len(run.lines()) > 10
    for line in run.lines():
        record = json.loads(line)  # raises on a plain line
        assert all(name in record for name in BASE_FIELDS), record
        assert record["timestamp"].endswith("Z") and "T" in record["timestamp"]
    loggers = {r["logger"] for r in run.records()}
    assert "uvicorn.error" in loggers  # uvicorn's own lines, in our format
    assert "uvicorn.access" not in loggers  # replaced by ours


def _access_of(run: Run, path: str, status: int = 200) -> dict[str, Any]:
    (line,) = [r for r in run.access() if r["path"] == path and r["status"] == status]
    return line


@pytest.mark.parametrize(("route", "path"), [
    ("chat", "/v1/chat/completions"), ("stream", "/v1/completions"), ("tgi", "/generate")])
def test_access_line_per_generation(run: Run, route: str, path: str) -> None:
    line = _access_of(run, path)
    assert all(name in line for name in ACCESS_FIELDS), line
    assert line["request_id"] == run.request_ids[route]
    assert (line["key_id"], line["model"], line["status"]) == (run.key_id, MODEL, 200)
    assert line["deployment"] == "native-0"  # the flag-level model's one deployment
    assert line["prompt_tokens"] > 0 and line["completion_tokens"] > 0
    assert line["ttft_s"] > 0 and line["total_s"] >= line["ttft_s"]
    assert line["queue_s"] is not None and line["generation_id"]
    assert run.request_ids["chat"] == "client-chosen-1"  # the client's id is kept


def test_streamed_line_counts_its_tokens(run: Run) -> None:
    assert _access_of(run, "/v1/completions")["completion_tokens"] == 5


def test_no_line_holds_the_key(run: Run) -> None:
    assert run.secret and run.secret not in run.stdout + run.stderr
    assert ADMIN_KEY not in run.stdout + run.stderr
    assert WRONG_KEY not in run.stdout + run.stderr


def test_a_refused_request_has_its_line_too(run: Run) -> None:
    line = _access_of(run, "/v1/chat/completions", 401)
    assert (line["key_id"], line["error"], line["completion_tokens"]) == (
        None, "unauthorized", None)


def test_health_and_metrics_polls_leave_no_access_line(run: Run) -> None:
    paths = [r["path"] for r in run.access()]
    assert "/health" not in paths and "/metrics" not in paths
    assert "/admin/keys" in paths and "/info" in paths


def test_health_and_info_name_the_load_stage_while_loading(run: Run) -> None:
    loads = [d["load"] for body in run.loading_health
             for m in body["models"].values() for d in m["deployments"].values() if "load" in d]
    weights = [load["stage"] for load in loads
               if load["stage"] and load["stage"]["name"] == "weights"]
    assert weights, run.loading_health[-3:]
    assert any(0 < (s["progress"] or 0) < 1 for s in weights)
    assert any(m["detail"].startswith("loading: weights") for body in run.loading_health
               for m in body["models"].values())
    during = [body for status, body in run.loading_info if status == 503 and "load" in body]
    assert during and all(list(body["load"]) == ["native-0"] for body in during)
    assert any(body["load"]["native-0"]["stage"]["name"] == "weights" for body in during
               if body["load"]["native-0"]["stage"])
    assert all("loading" in body["error"] for body in during)
    progress = [r for r in run.records() if r["message"].startswith("reading weights: ")]
    assert len(progress) >= 2  # every ~10% (>= 1 s apart) or 5 s when not on a terminal


def test_info_lists_the_finished_stages(run: Run) -> None:
    load = run.info["load"]
    names = [s["name"] for s in load["stages"]]
    assert names[:2] == ["checkpoint metadata", "weights"] and "kv cache" in names
    assert load["stage"] is None and all(s["seconds"] >= 0 for s in load["stages"])
    assert next(s for s in load["stages"] if s["name"] == "weights")["seconds"] >= 1.0
