"""Log formats and the access line, in process (the JSON run of `switchyard serve` with keys
on is tests/auth/test_json_logs.py)."""

from __future__ import annotations

import json
import logging
import sys

import httpx
import pytest

from backends.base import LoadReport, LoadStage
from backends.native.loading.load_progress import LoadTracker, describe, weight_progress
from gateway.app import create_app
from gateway.log_format import TEXT_FORMAT, JsonFormatter, log_config
from gateway.settings import Settings
from tests.gateway.echo_backend import EchoBackend


def _record(message: str, **fields: object) -> logging.LogRecord:
    record = logging.LogRecord("switchyard.test", logging.WARNING, __file__, 1, message, (),
                               None)
    record.fields = fields
    return record


def test_json_line_has_timestamp_level_logger_message_and_fields() -> None:
    line = json.loads(JsonFormatter().format(_record("hello", request_id="r1", status=200)))
    assert (line["level"], line["logger"], line["message"]) == (
        "warning", "switchyard.test", "hello")
    assert line["timestamp"].endswith("Z") and (line["request_id"], line["status"]) == ("r1", 200)


def test_json_line_carries_the_traceback() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), None)
        record.exc_info = sys.exc_info()
    line = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in line["exception"] and "\n" not in JsonFormatter().format(record)


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_log_config_routes_uvicorn_through_one_handler(fmt: str) -> None:
    config = log_config("debug", fmt)  # type: ignore[arg-type]
    assert config["loggers"]["uvicorn.access"]["propagate"] is False
    assert config["loggers"]["uvicorn.error"] == {"handlers": [], "propagate": True,
                                                  "level": logging.DEBUG}
    assert config["root"]["handlers"] == ["stderr"]
    assert ("()" in config["formatters"]["switchyard"]) == (fmt == "json")


def _access(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "switchyard.access"]


def test_one_access_line_per_request_not_for_health(serve_app, caplog) -> None:
    url = serve_app(create_app(Settings(), backends={"echo": EchoBackend(name="echo")}))
    caplog.set_level(logging.INFO, logger="switchyard.access")
    for _ in range(3):
        httpx.get(f"{url}/health")
    answer = httpx.post(f"{url}/v1/completions", headers={"x-request-id": "bad id!"},
                        json={"model": "echo", "prompt": "hi there", "max_tokens": 3})
    assert answer.status_code == 200
    (record,) = _access(caplog)
    fields = record.fields  # type: ignore[attr-defined]
    assert fields["request_id"] == answer.headers["x-request-id"] != "bad id!"
    assert (fields["model"], fields["deployment"], fields["status"]) == ("echo", "echo", 200)
    assert fields["completion_tokens"] > 0 and fields["ttft_s"] is not None
    assert record.getMessage().startswith("POST /v1/completions 200 request_id=")


def test_health_polls_are_logged_at_debug(serve_app, caplog) -> None:
    url = serve_app(create_app(Settings(), backends={"echo": EchoBackend(name="echo")}))
    caplog.set_level(logging.DEBUG, logger="switchyard.access")
    httpx.get(f"{url}/health")
    assert [r.levelno for r in _access(caplog)] == [logging.DEBUG]


def test_tracker_reports_the_stage_its_progress_and_the_finished_ones() -> None:
    tracker = LoadTracker()
    assert describe(tracker.report()) == "loading: starting"
    tracker.begin("weights")
    tracker.progress(0.5, "reading safetensors")
    assert describe(tracker.report()) == "loading: weights 50%"
    tracker.end("weights", 1.25)
    report = tracker.report()
    assert report.current is None
    assert report.finished == (LoadStage("weights", 1.25, detail="reading safetensors"),)
    assert LoadReport(None, report.finished).report()["stages"][0]["seconds"] == 1.25


def test_weight_progress_logs_about_every_tenth(caplog, monkeypatch) -> None:
    monkeypatch.setattr("backends.native.loading.load_progress.LOG_GAP_S", 0.0)
    caplog.set_level(logging.INFO, logger="backends.native.loading.load_progress")
    assert list(weight_progress(range(20), 20)) == list(range(20))
    lines = [r.getMessage() for r in caplog.records if "reading weights" in r.getMessage()]
    assert len(lines) == 10 and lines[-1] == "reading weights: 20/20 (100%) tensors"


def test_a_fast_load_logs_no_progress_lines(caplog) -> None:
    caplog.set_level(logging.INFO, logger="backends.native.loading.load_progress")
    assert len(list(weight_progress(range(20), 20))) == 20
    assert not [r for r in caplog.records if "reading weights" in r.getMessage()]


def test_log_format_flag_and_environment(monkeypatch) -> None:
    from gateway.cli import build_parser, settings_from_args

    def parsed(*argv: str) -> Settings:
        return settings_from_args(build_parser().parse_args(["serve", *argv]))

    assert parsed().log_format == "text"
    assert parsed("--log-format", "JSON").log_format == "json"
    monkeypatch.setenv("SWITCHYARD_LOG_FORMAT", "json")
    assert parsed().log_format == "json"
    with pytest.raises(ValueError):
        parsed("--log-format", "xml")


def test_a_text_access_line_cannot_be_forged_by_the_path(serve_app, caplog) -> None:
    """A decoded `/%0A...` path, or a CR, tab or backslash in it, stays escaped on its line."""
    url = serve_app(create_app(Settings(), backends={"echo": EchoBackend(name="echo")}))
    caplog.set_level(logging.INFO, logger="switchyard.access")
    forged = "/x%0A2026-01-05 10:00:00,000 INFO switchyard.access: POST /admin 200%0D%09%5C"
    assert httpx.get(url + forged).status_code == 404
    (record,) = _access(caplog)
    line = logging.Formatter(TEXT_FORMAT).format(record)
    assert "\n" not in line and "\r" not in line and "\t" not in line
    assert line.split(": ", 1)[1].startswith(
        "GET /x\\x0a2026-01-05\\x2010:00:00,000\\x20INFO")
    assert "\\x0d\\x09\\x5c 404 " in line
    assert record.fields["path"].startswith("/x\n2026")  # type: ignore[attr-defined]
