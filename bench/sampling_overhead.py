"""What structured outputs and logprobs cost at decode: batch-16 step time, on versus off.

The default model (SmolLM2-135M, its real tokenizer and weights) in the native engine, offline.
Each round runs four configurations back to back on the same 16 chat prompts, 64 new tokens,
sampled at temperature 0.8 with fixed seeds:

- `plain`: no constraint, no logprobs (EOS ignored, so the batch stays at 16);
- `json_schema`: a schema with a free-text field (masks computed every step, overlapped with
  the forward pass);
- `logprobs`: `logprobs` with `top_logprobs=5` (EOS ignored);
- `json_schema+logprobs`.

The figure is the mean engine step time over decode steps that ran all 16 sequences (a
constrained answer may finish early; those smaller steps are left out), as tokens/s = 16 /
step time. Rounds alternate the configurations so that this shared machine's noise hits
them alike; the median and the best round are reported, each with its ratio to `plain`.

    .venv/bin/python -m bench.sampling_overhead [--threads 2] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import configure_threads, facts_line, machine_facts, write_json  # noqa: E402

BATCH = 16
STORY_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "genre": {"type": "string", "enum": ["fable", "myth", "tale"]},
        "story": {"type": "string"},
    },
    "required": ["title", "genre", "story"],
    "additionalProperties": False,
}
CONFIGS = ("plain", "json_schema", "logprobs", "json_schema+logprobs")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--json", default=None, help="also write figures + machine facts here")
    return parser.parse_args()


def load_engine():  # noqa: ANN201 - torch types load lazily, after configure_threads
    from backends.default_model import default_model_path
    from backends.native.config import EngineConfig
    from backends.native.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=default_model_path(), max_total_tokens=1024))


def prompts(engine) -> list[list[int]]:  # noqa: ANN001
    return [
        engine.tokenizer.encode_chat([{"role": "user", "content": (
            f"Tell story number {i} about a fox and a crow, as JSON with a title, a genre "
            "(fable, myth or tale) and the story.")}])
        for i in range(BATCH)
    ]


def sampling_for(config: str, new_tokens: int, seed: int):  # noqa: ANN201
    from backends.base import SamplingParams, StructuredOutput

    structured = None
    if "json_schema" in config:
        structured = StructuredOutput("json_schema", json.dumps(STORY_SCHEMA))
    logprobs = "logprobs" in config
    return SamplingParams(
        max_tokens=new_tokens, temperature=0.8, seed=seed, ignore_eos=structured is None,
        logprobs=logprobs, top_logprobs=5 if logprobs else 0, structured=structured,
    )


def run_config(engine, ids: list[list[int]], config: str, new_tokens: int) -> dict[str, float]:  # noqa: ANN001
    engine.step_timings.clear()
    start = time.perf_counter()
    outputs = 0
    for i, prompt in enumerate(ids):
        sampling = sampling_for(config, new_tokens, seed=i)
        grammar = engine.grammars.compile(sampling.structured) if sampling.structured else None
        engine.add_request(f"{config}-{i}-{time.monotonic_ns()}", prompt, sampling,
                           grammar=grammar)
    while engine.has_work():
        outputs += sum(len(o.tokens) for o in engine.step())
    wall = time.perf_counter() - start
    full = [t.seconds for t in engine.step_timings
            if t.method == "decode" and t.batch_size == BATCH]
    step = statistics.mean(full) if full else float("nan")
    return {"decode_step_s": step, "decode_tok_s": BATCH / step, "full_batch_steps": len(full),
            "output_tok_s": outputs / wall}


def main() -> None:
    args = parse_args()
    configure_threads(args.threads, bind=False)
    engine = load_engine()
    facts = machine_facts(str(engine.loaded.dtype).removeprefix("torch."), args.threads)
    print(facts_line(facts))
    ids = prompts(engine)
    for config in CONFIGS:  # warm-up: batch-16 kernels, the grammar compile and its cache
        run_config(engine, ids, config, 4)
    rounds: dict[str, list[dict[str, float]]] = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            rounds[config].append(run_config(engine, ids, config, args.new_tokens))
    results = {}
    plain = statistics.median(r["decode_tok_s"] for r in rounds["plain"])
    plain_best = max(r["decode_tok_s"] for r in rounds["plain"])
    for config, runs in rounds.items():
        rate = statistics.median(r["decode_tok_s"] for r in runs)
        best = max(r["decode_tok_s"] for r in runs)  # the round least disturbed by neighbours
        steps = min(r["full_batch_steps"] for r in runs)
        results[config] = {"decode_tok_s": rate, "vs_plain": rate / plain, "best_tok_s": best,
                           "best_vs_plain": best / plain_best, "min_full_batch_steps": steps,
                           "runs": runs}
        print(f"{config:22s} batch-{BATCH} decode median {rate:6.1f} tok/s x{rate / plain:.3f},"
              f" best {best:6.1f} tok/s x{best / plain_best:.3f} of plain"
              f"  ({steps}+ full-batch steps a round)")
    write_json(args.json, facts, results)


if __name__ == "__main__":
    main()
