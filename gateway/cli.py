"""`switchyard serve`: TGI's launcher flags, also as SWITCHYARD_* env vars (flags win).
`switchyard keys`: API key administration (gateway/cli_keys.py)."""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from backends.quantized.config import KERNEL_CHOICES
from gateway.admin.cli_keys import add_auth_flags, add_keys_command, run_keys
from gateway.log_format import configure_logging
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
     "most tokens in one step, decode rows included when chunked (default 512 on CPU, "
     "4096 on GPU or unchunked)"),
    (("--max-batch-total-tokens",), "max_batch_total_tokens", int, "KV cache capacity in tokens"),
    (("--block-size",), "block_size", int, "tokens per KV cache block"),
    (("--num-threads",), "num_threads", int, "CPU threads for the model"),
    (("--kv-cache-memory",), "kv_cache_memory", str,
     "KV cache budget: bytes (8GiB, 512M) or a fraction of free memory (0.9)"),
    (("--max-concurrent-requests",), "max_concurrent_requests", int,
     "requests in flight before new ones get 429"),
    (("--max-queued-requests",), "max_queued_requests", int,
     "requests waiting beyond the running batch before new ones get 429 (default: unbounded)"),
    (("--max-queued-tokens",), "max_queued_tokens", int,
     "prompt tokens waiting to be scheduled before new requests get 429 (default: unbounded)"),
    (("--queue-timeout",), "queue_timeout", float,
     "seconds a request may wait to be scheduled, then 503 (default: none)"),
    (("--request-timeout",), "request_timeout", float,
     "seconds a request may take in all, then it is stopped (default: none)"),
    (("--waiting-served-ratio",), "waiting_served_ratio", float,
     "without chunked prefill: waiting/running ratio that lets new requests join"),
    (("--max-waiting-tokens",), "max_waiting_tokens", int,
     "without chunked prefill: decode steps after which waiting requests join anyway"),
    (("--prefix-caching",), "prefix_caching", str, "true (default) | false"),
    (("--compile",), "compile", str, "torch.compile the decode attention: true (default) | false"),
    (("--compile-decode-step",), "compile_decode_step", str,
     "decode-only steps through compiled regions (faster decode, a few seconds more "
     "at start): true (default) | false"),
    (("--compile-prefill-step",), "compile_prefill_step", str,
     "prefill and mixed steps: each layer's norms, projections, rotary and MLP compiled "
     "around its attention: true | false (default: true for dense weights, false for "
     "quantized ones, where it gains least for the most start-up time)"),
    (("--prepack-weights",), "prepack_weights", str,
     "CPU: dense weights prepacked for oneDNN at load: true (default) | false"),
    (("--bf16-linear-kernel",), "bf16_linear_kernel", str,
     "CPU, bf16: prepacked linears through our kernel where the CPU has AVX-512-BF16: "
     "true (default) | false (oneDNN)"),
    (("--f32-linear-kernel",), "f32_linear_kernel", str,
     "CPU, float32: prepacked linears through our AVX2 FMA kernel where our kernels run AVX2 "
     "code (AVX2-only CPUs): true (default) | false (oneDNN)"),
    (("--greedy-head",), "greedy_head", str,
     "CPU, bf16 lm_head on our kernel: greedy steps pick each token from an int8 bound and a "
     "few exact logits, the same token as the full logits: true (default) | false"),
    (("--attention-kernels",), "attention_kernels", str,
     "CPU, with --compile: decode and prompt attention through our C++ kernels where they "
     "are built: true (default) | false (inductor's code and torch's SDPA)"),
    (("--cache-dir",), "cache_dir", str,
     "startup cache (GGUF metadata, tokenizer, packed weights, compiled kernels); "
     "default ~/.cache/switchyard, 'none' turns it off"),
    (("--max-request-body-bytes", "--payload-limit"), "max_request_body_bytes", str,
     "largest request body (bytes, or 8MiB, 512K); larger ones get 413 (default 8MiB)"),
    (("--max-messages",), "max_messages", int, "most chat messages in one request (default 2048)"),
    (("--max-stop-sequences",), "max_stop_sequences", int,
     "most stop strings in one request (default 4, as OpenAI and TGI)"),
    (("--max-stop-length",), "max_stop_length", int,
     "longest stop string in characters (default 512)"),
    (("--max-output-tokens",), "max_output_tokens", int,
     "most tokens a request may generate: a larger max_tokens / max_new_tokens is refused, "
     "an omitted one is capped; default: only the model's --max-total-tokens bounds it"),
    (("--shutdown-timeout",), "shutdown_timeout", float,
     "seconds in-flight requests may finish after SIGTERM (default 30)"),
    (("--log-level",), "log_level", str, "critical | error | warning | info | debug"),
    (("--log-format",), "log_format", str,
     "text (default) | json: one JSON object per line, with an access line per request"),
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
    serve.add_argument(
        "--no-playground", dest="playground", action="store_false",
        default=argparse.SUPPRESS, help="do not serve the chat page at /playground",
    )
    add_auth_flags(serve)
    add_keys_command(commands)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the flags given (only those), the environment filling the rest."""
    given: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "command"}
    return Settings(**given)


def serve(settings: Settings) -> None:
    prefer_huge_pages()
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
        print(f"switchyard: invalid settings:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.command == "serve":
        serve(settings)


if __name__ == "__main__":
    main()
