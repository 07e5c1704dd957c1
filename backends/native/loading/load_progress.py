"""Which load stage a model is in, for /health and /info while it loads.

The loading thread runs under `tracking(tracker)`; `LoadStages` (startup_cache.py) begins
and ends each stage on the tracker found there, and reading weights reports its progress
(`weight_progress`). The event loop reads `tracker.report()` (plain data, under a lock).

Reading weights shows a tqdm bar when stderr is a terminal and plain text logging is on;
otherwise (JSON logs, a file, a pipe) it logs a line every ~10% or 5 s.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

from tqdm import tqdm

from backends.base import LoadReport, LoadStage

log = logging.getLogger(__name__)
T = TypeVar("T")
LOG_EVERY_FRACTION = 0.1
LOG_EVERY_S = 5.0
LOG_GAP_S = 1.0  # at least this long between two lines (a fast load logs none)
# Tests only: seconds to sleep per tensor read, so a load is slow enough to watch.
DELAY_ENV = "SWITCHYARD_TEST_WEIGHT_DELAY_S"


class LoadTracker:
    """One model's load: the stage running now and the finished ones (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._began = time.monotonic()
        self._current: LoadStage | None = LoadStage("starting")
        self._finished: list[LoadStage] = []

    def begin(self, name: str, detail: str = "") -> None:
        with self._lock:
            self._current = LoadStage(name, detail=detail)

    def progress(self, fraction: float, detail: str | None = None) -> None:
        with self._lock:
            if self._current is not None:
                current = self._current
                self._current = LoadStage(current.name, progress=min(max(fraction, 0.0), 1.0),
                                          detail=current.detail if detail is None else detail)

    def end(self, name: str, seconds: float, cached: bool = False) -> None:
        with self._lock:
            detail = self._current.detail if self._current is not None else ""
            self._finished.append(LoadStage(name, round(seconds, 3), cached, detail=detail))
            self._current = None

    def report(self) -> LoadReport:
        with self._lock:
            return LoadReport(self._current, tuple(self._finished),
                              time.monotonic() - self._began)


_tracker: ContextVar[LoadTracker | None] = ContextVar("switchyard_load_tracker", default=None)


@contextmanager
def tracking(tracker: LoadTracker) -> Iterator[LoadTracker]:
    """Stages run in this block (in this thread) report to `tracker`."""
    token = _tracker.set(tracker)
    try:
        yield tracker
    finally:
        _tracker.reset(token)


def current_tracker() -> LoadTracker | None:
    return _tracker.get()


def describe(report: LoadReport) -> str:
    """`loading: weights 42%` for a health detail."""
    stage = report.current
    if stage is None:
        return "loading"
    percent = f" {stage.progress:.0%}" if stage.progress is not None else ""
    return f"loading: {stage.name}{percent}"


def _json_logging() -> bool:
    handlers = logging.getLogger().handlers
    return any(getattr(h.formatter, "json_lines", False) for h in handlers)


def json_logs_everywhere() -> None:
    """With JSON logs on, libraries' own stderr handlers (torch installs one per logger
    family) would write plain lines: their records go to the root handler instead."""
    if not _json_logging():
        return
    for logger in list(logging.root.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue
        plain = [h for h in logger.handlers if type(h) is logging.StreamHandler
                 and h.stream in (sys.stderr, sys.stdout)]
        for handler in plain:
            logger.removeHandler(handler)
        if plain and not logger.handlers:
            logger.propagate = True


def _use_bar() -> bool:
    return sys.stderr.isatty() and not _json_logging()


class _Periodic:
    """A log line every LOG_EVERY_FRACTION of the total, or every LOG_EVERY_S seconds, but
    never two within LOG_GAP_S."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self._next_fraction = LOG_EVERY_FRACTION
        self._last = time.monotonic()

    def step(self, count: int) -> None:
        now = time.monotonic()
        fraction = min(count / self.total, 1.0) if self.total else None
        due = now - self._last >= LOG_EVERY_S
        if fraction is not None and fraction >= self._next_fraction:
            due = due or now - self._last >= LOG_GAP_S
            while self._next_fraction <= fraction:
                self._next_fraction += LOG_EVERY_FRACTION
        if due:
            self._last = now
            of = f"/{self.total} ({fraction:.0%})" if fraction is not None else ""
            log.info("reading weights: %d%s tensors", count, of)


def weight_progress(tensors: Iterable[T], total: int | None) -> Iterator[T]:
    """`tensors`, reporting progress to the tracker, a tqdm bar or periodic log lines."""
    tracker = current_tracker()
    delay = float(os.environ.get(DELAY_ENV) or 0)
    bar = _use_bar()
    periodic = None if bar else _Periodic(total)
    shown = tqdm(tensors, desc="loading weights", unit=" tensors", total=total,
                 disable=not bar)
    for count, item in enumerate(shown, start=1):
        if delay:
            time.sleep(delay)
        yield item
        if tracker is not None and total:
            tracker.progress(count / total)
        if periodic is not None:
            periodic.step(count)


def tensor_total(path: str, fmt: str, files: Iterable[str] = ()) -> int | None:
    """How many tensors a checkpoint holds, read from headers only (None: not known).
    GGUF: the header's tensor count; safetensors: the keys of each file's header."""
    try:
        if fmt == "gguf":
            with open(path, "rb") as f:
                header = f.read(16)
            return struct.unpack_from("<Q", header, 8)[0] if header[:4] == b"GGUF" else None
        if fmt == "safetensors":
            from safetensors import safe_open

            total = 0
            for file in files:
                with safe_open(file, framework="pt") as f:
                    total += len(f.keys())
            return total or None
    except (OSError, ValueError, struct.error):
        log.debug("cannot count the tensors of %s", path, exc_info=True)
    return None
