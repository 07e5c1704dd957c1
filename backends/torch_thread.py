"""One thread for all of a backend's torch work: loading, warm-up and every step after.

libgomp lets an idle OpenMP worker spin for the next parallel region only while the
process's OpenMP threads (every team of every thread that ever ran a parallel region and is
still alive) fit the CPUs. Past that it spins ~100 times and sleeps, and every region of a
step then pays a futex wake-up (no `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` lifts that limit).
Loading in `asyncio.to_thread` and stepping in a thread of its own made two teams on two
cores: the default model's batch-1 decode step took 42 ms over HTTP against 20 ms in one
thread, with both cores a third idle.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

log = logging.getLogger(__name__)
_started: list[threading.Thread] = []  # every torch thread this process started


async def start_torch_thread(
    name: str, load: Callable[[], T], serve: Callable[[T], None],
) -> tuple[threading.Thread, T]:
    """Start a daemon thread that runs `load()` and then `serve(loaded)`; return the thread
    and what `load` returned once it has, or raise what it raised (the thread then ends)."""
    loop = asyncio.get_running_loop()
    loaded: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if loaded.done():  # start() was cancelled while the model loaded
            return
        if error is not None:
            loaded.set_exception(error)
        else:
            loaded.set_result(result)  # type: ignore[arg-type]

    def report(result: T | None, error: BaseException | None) -> None:
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: nobody is waiting
            pass

    def body() -> None:
        try:
            result = load()
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting start()
            report(None, exc)
            return
        report(result, None)
        serve(result)

    context = contextvars.copy_context()  # as asyncio.to_thread would
    thread = threading.Thread(target=context.run, args=(body,), name=name, daemon=True)
    _warn_if_not_alone(name)
    _started.append(thread)
    thread.start()
    return thread, await loaded


def _warn_if_not_alone(name: str) -> None:
    _started[:] = [t for t in _started if t.is_alive()]
    if _started:
        log.warning(
            "model thread %r starts beside %s in this process: with two threads running torch, "
            "OpenMP's workers sleep between parallel regions and steps can take up to 2x "
            "longer; serve one native or transformers model per process where speed matters",
            name, ", ".join(repr(t.name) for t in _started))
