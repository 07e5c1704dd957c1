"""`switchyard serve`: TGI's launcher flags, also as SWITCHYARD_* env vars (flags win;
gateway/flag_table.py lists them). `switchyard keys`: API key administration
(gateway/admin/cli_keys.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from gateway.admin.cli_keys import add_keys_command, run_keys
from gateway.flag_parser import (
    DESCRIPTION,
    HelpFormatter,
    add_serve_flags,
    describe_errors,
    env_var,
)
from gateway.log_format import configure_logging
from gateway.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve", help="serve models over an OpenAI-compatible API", description=DESCRIPTION,
        usage="%(prog)s [flags]", formatter_class=HelpFormatter)
    add_serve_flags(serve)
    add_keys_command(commands)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the flags given (only those), the environment filling the rest."""
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command"}
    return Settings(**given)


def serve(settings: Settings) -> None:
    prefer_huge_pages()
    export_cpu_kernels(settings)
    from gateway.app import create_app
    from gateway.drain import build_server

    configure_logging(settings.log_level, settings.log_format)
    failures: list[BaseException] = []

    def stop(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    # The port opens at once: /health answers 503 while the models load (TGI-style probes).
    try:
        app = create_app(settings, load_in_background=True, on_load_failure=stop,
                         on_loaded=freeze_startup_heap)
    except ValueError as exc:  # the models file, or a backend's options (it names the field)
        _fail(settings, f"switchyard: invalid configuration: {exc}")
        raise SystemExit(2) from None
    server = build_server(app, settings)  # drains on SIGTERM (gateway/drain.py)
    server.run()
    if failures:
        _fail(settings, f"switchyard: a model could not be loaded: {failures[0]}")
        raise SystemExit(1)


def prefer_huge_pages() -> None:
    """torch's CPU allocator backs its allocations of 2 MB and more (weights, the KV cache)
    with transparent huge pages when THP_MEM_ALLOC_ENABLE is set before its first allocation,
    i.e. before any backend loads: fewer TLB misses, and hardware prefetchers that run past
    4 KB page edges (W1's decode attention at 64 rows 10-15% faster on a 2-core AVX2 EPYC;
    the linears, compute-bound, the same). An explicit THP_MEM_ALLOC_ENABLE=0 wins."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def export_cpu_kernels(settings: Settings) -> None:
    """The kernel builder (backends/cpu_kernels/build.py) reads SWITCHYARD_CPU_KERNELS from the
    process environment when a model loads: a --cpu-kernels flag reaches it there."""
    if settings.cpu_kernels is not None:
        os.environ[env_var("cpu_kernels")] = settings.cpu_kernels


def freeze_startup_heap() -> None:
    """Once every model is loaded: what start-up left (torch, transformers, compiled graphs:
    ~545k objects for W1) leaves the cyclic collector's reach. Its full collections walked it
    all, up to ~0.3 s each with the GIL held, stalling the engine's step and every stream
    once every few thousand tokens (vLLM freezes after start-up too). What is alive now is
    freed by reference counts alone from then on; the server keeps it for its life."""
    gc.collect()
    gc.freeze()
    logging.getLogger("switchyard.cli").info(
        "start-up heap frozen: %d objects out of the cyclic collector's reach",
        gc.get_freeze_count())


def _fail(settings: Settings, message: str) -> None:
    """A fatal message: a plain line, or a JSON record with --log-format json."""
    if settings.log_format == "json":
        logging.getLogger("switchyard.cli").critical("%s", message)
    else:
        print(message, file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "keys":
        raise SystemExit(run_keys(args))
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"switchyard: invalid settings:\n{describe_errors(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "serve":
        serve(settings)


if __name__ == "__main__":
    main()
