"""`switchyard serve`: TGI's launcher flags, also as SWITCHYARD_* env vars (flags win).
`switchyard keys`: API key administration (gateway/cli_keys.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from backends.quantized.config import KERNEL_CHOICES
from gateway.admin.cli_keys import add_auth_flags, add_keys_command, run_keys
from gateway.settings import Settings

# (flags, settings field, type, help)
_FLAGS: tuple[tuple[tuple[str, ...], str, type, str], ...] = (
    (("--model-id",), "model_id", str, "Hugging Face folder, .gguf file, or 'default'"),
    (("--served-model-name",), "served_model_name", str, "name clients use (default: model id)"),
    (("--backend",), "backend", str, "native (default)"),
    (("--config-file",), "config_file", str, "YAML file declaring several models"),
    (("--hostname",), "hostname", str, "address to listen on (default 127.0.0.1)"),
    (("--port",), "port", int, "port to listen on (default 8080)"),
    (("--dtype",), "dtype", str, "auto | bfloat16 | float16 | float32"),
    (("--quantize",), "quantize", str,
     "gptq | awq | gguf (as the checkpoint is), eetq | bitsandbytes | bitsandbytes-nf4 | "
     "bitsandbytes-fp4 (at load), none (dense; dequantizes a .gguf)"),
    (("--device",), "device", str, "cpu | cuda | cuda:N"),
    (("--max-input-tokens", "--max-input-length"), "max_input_tokens", int,
     "longest prompt in tokens"),
    (("--max-total-tokens",), "max_total_tokens", int, "prompt + generated tokens per request"),
    (("--max-batch-size",), "max_batch_size", int, "most sequences in one step"),
    (("--max-batch-prefill-tokens",), "max_batch_prefill_tokens", int,
     "most prompt tokens prefilled in one step"),
    (("--max-batch-total-tokens",), "max_batch_total_tokens", int, "KV cache capacity in tokens"),
    (("--block-size",), "block_size", int, "tokens per KV cache block"),
    (("--num-threads",), "num_threads", int, "CPU threads for the model"),
    (("--kv-cache-memory",), "kv_cache_memory", str,
     "KV cache budget: bytes (8GiB, 512M) or a fraction of free memory (0.9)"),
    (("--max-concurrent-requests",), "max_concurrent_requests", int,
     "requests in flight before new ones get 429"),
    (("--waiting-served-ratio",), "waiting_served_ratio", float,
     "without chunked prefill: waiting/running ratio that lets new requests join"),
    (("--max-waiting-tokens",), "max_waiting_tokens", int,
     "without chunked prefill: decode steps after which waiting requests join anyway"),
    (("--prefix-caching",), "prefix_caching", str, "true (default) | false"),
    (("--compile",), "compile", str, "torch.compile the decode attention: true (default) | false"),
    (("--prepack-weights",), "prepack_weights", str,
     "CPU: dense weights prepacked for oneDNN at load: true (default) | false"),
    (("--cache-dir",), "cache_dir", str,
     "startup cache (GGUF metadata, tokenizer, packed weights, compiled kernels); "
     "default ~/.cache/switchyard, 'none' turns it off"),
    (("--log-level",), "log_level", str, "critical | error | warning | info | debug"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="switchyard", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve models over an OpenAI-compatible API")
    for flags, dest, kind, help_text in _FLAGS:
        serve.add_argument(*flags, dest=dest, type=kind, help=help_text, default=argparse.SUPPRESS)
    serve.add_argument(
        "--quantized-kernels", dest="quantized_kernels", choices=KERNEL_CHOICES,
        default=argparse.SUPPRESS,
        help="GPTQ / AWQ kernels: auto (gptqmodel's CUDA kernels when installed, else native), "
             "native, gptqmodel (forced)",
    )
    serve.add_argument(
        "--no-chunked-prefill", dest="chunked_prefill", action="store_false",
        default=argparse.SUPPRESS, help="prefill each prompt whole, in one step",
    )
    add_auth_flags(serve)
    add_keys_command(commands)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the flags given (only those), the environment filling the rest."""
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command"}
    return Settings(**given)


def serve(settings: Settings) -> None:
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(
        level=settings.log_level.upper() if settings.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    failures: list[BaseException] = []

    def stop(exc: BaseException) -> None:
        failures.append(exc)
        server.should_exit = True

    # The port opens at once: /health answers 503 while the models load (TGI-style probes).
    try:
        app = create_app(settings, load_in_background=True, on_load_failure=stop)
    except ValueError as exc:  # the models file, or a backend's options (it names the field)
        print(f"switchyard: invalid configuration: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    server = uvicorn.Server(uvicorn.Config(
        app, host=settings.hostname, port=settings.port, log_level=settings.log_level))
    server.run()
    if failures:
        print(f"switchyard: a model could not be loaded: {failures[0]}", file=sys.stderr)
        raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "keys":
        raise SystemExit(run_keys(args))
    try:
        settings = settings_from_args(args)
    except ValidationError as exc:
        print(f"switchyard: invalid settings:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "serve":
        serve(settings)


if __name__ == "__main__":
    main()
