"""Log formats (`--log-format text|json`) and the one logging setup of `switchyard serve`.

Both formats go to stderr through one handler on the root logger; uvicorn's loggers
(`uvicorn`, `uvicorn.error`) propagate to it, and `uvicorn.access` is off: the gateway
writes its own access line per request (gateway/access_log.py).

- text: `2026-01-05 10:00:00,123 INFO switchyard.gateway: message` (as before).
- json: one object per line: `timestamp` (ISO 8601, UTC), `level`, `logger`, `message`,
  any structured fields the record carries (an access line's request id, key id, model,
  tokens, timings: `extra={"fields": {...}}`), and `exception` with a traceback.
"""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FIELDS_ATTR = "fields"  # a record's structured fields: logger.info(msg, extra={"fields": {}})
UVICORN_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.asgi")
TRACE_LEVEL = 5  # uvicorn's


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, FIELDS_ATTR, None)
    return fields if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module doc)."""

    json_lines = True  # backends look for this to skip terminal progress bars

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, UTC).isoformat(
                timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def _level(level: str) -> int:
    return TRACE_LEVEL if level.lower() == "trace" else logging.getLevelName(level.upper())


def log_config(level: str = "info", fmt: LogFormat = "text") -> dict[str, Any]:
    """The `logging.config.dictConfig` of the whole process; uvicorn gets it as `log_config`
    (and applies it again when the server starts: the same handlers, in the same format)."""
    formatter: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if fmt == "json" else {"format": TEXT_FORMAT})
    numeric = _level(level)
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"switchyard": formatter},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "switchyard",
                                "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["stderr"], "level": numeric},
        "loggers": {
            **{name: {"handlers": [], "propagate": True, "level": numeric}
               for name in UVICORN_LOGGERS},
            # uvicorn's per-request lines are replaced by ours (gateway/access_log.py)
            "uvicorn.access": {"handlers": [], "propagate": False, "level": logging.WARNING},
        },
    }


def configure_logging(level: str = "info", fmt: LogFormat = "text") -> None:
    """Set up the process's logging before anything logs (the CLI calls it first)."""
    logging.addLevelName(TRACE_LEVEL, "TRACE")
    logging.config.dictConfig(log_config(level, fmt))
    if fmt == "json":
        logging.captureWarnings(True)  # warnings.warn lines become JSON records too
        _library_handlers_to_root()


def _library_handlers_to_root() -> None:
    """Libraries that install their own stderr handler (transformers does) would write
    plain lines: their records go to the root handler instead."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
