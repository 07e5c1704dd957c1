"""A decode step of a Qwen3 on the C++ decode layers (`fused_decode_layers.py`, with their
per-head q / k norm) against the same engine on its compiled layer region, in alternating
rounds in one process (so that whatever else runs on the machine slows both alike).

The model is W1's shape (bench/common.py LLAMA_125M: 768 hidden, 12 layers, 12 heads of 64)
as a Qwen3 (q_norm / k_norm), random: `q4` is float32 with Q4_0 linears from a GGUF file
(`q4_decode_layers`), `bf16` bf16 safetensors on our bf16 kernel (`bf16_decode_layers`, an
AVX-512-BF16 CPU only). Prints each path's median and best ms a step and the median of the
per-round ratios region / fused.

    .venv/bin/python -m bench.fused_layers_qwen3 [--kind q4 bf16] [--batch 1 16] [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make `bench` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (  # noqa: E402
    LLAMA_125M,
    configure_threads,
    facts_line,
    machine_facts,
    write_default_tokenizer,
    write_json,
)
from bench.profile_step import build_engine, finish_all, start_batch  # noqa: E402

VOCAB = 49152  # the default model's tokenizer, copied into the GGUF file


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", nargs="+", default=["q4", "bf16"], choices=["q4", "bf16"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=10, help="decode steps per timed round")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--bind", action="store_true")
    parser.add_argument("--json", default=None)
    return parser.parse_args()


def write_qwen3(folder: Path) -> Path:
    """A random float32 Qwen3 of W1's shape, with the default model's tokenizer."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    options = {**LLAMA_125M, "vocab_size": VOCAB, "head_dim": 64, "tie_word_embeddings": False}
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**options)).save_pretrained(folder, safe_serialization=True)
    write_default_tokenizer(folder)
    return folder


def write_q4_gguf(folder: Path, path: Path) -> Path:
    """`folder`'s Qwen3 as a GGUF file: linears Q4_0, embedding Q8_0, norms float32."""
    import gguf
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from backends.default_model import default_model_path

    config = AutoConfig.from_pretrained(folder)
    writer = gguf.GGUFWriter(str(path), "qwen3")
    source = gguf.GGUFReader(default_model_path())
    for key, field in source.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(key, field.contents(), field.types[0], sub)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config.num_hidden_layers)
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        values = tensor.float().numpy()
        qtype = (gguf.GGMLQuantizationType.Q4_0 if name.endswith("_proj.weight")
                 else gguf.GGMLQuantizationType.Q8_0 if values.ndim == 2 else None)
        gguf_name = names.get_name(name, try_suffixes=(".weight",))
        if qtype is None:
            writer.add_tensor(gguf_name, values)
        else:
            writer.add_tensor(gguf_name, quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def timed_steps(engine: Any, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def compare(engine: Any, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    """Rounds of `--steps` steps fused, then on the region (the order flipping each round)."""
    step = engine.runner.decode_step
    fused = step.fused_layers
    paths = {"fused": fused, "region": None}
    start_batch(engine, batch, args.prompt_len, f"q{batch}")
    step.fused_layers = None
    timed_steps(engine, 3)  # the region's graphs for this batch size
    times: dict[str, list[float]] = {name: [] for name in paths}
    for round_index in range(args.rounds):
        order = list(paths) if round_index % 2 == 0 else list(reversed(paths))
        for name in order:
            step.fused_layers = paths[name]
            times[name].append(timed_steps(engine, args.steps))
    step.fused_layers = fused
    finish_all(engine, f"q{batch}", batch)
    ratios = [r / f for f, r in zip(times["fused"], times["region"], strict=True)]
    return {"ms_per_step": {n: {"median": statistics.median(t), "best": min(t), "rounds": t}
                            for n, t in times.items()},
            "ratio_region_over_fused": statistics.median(ratios)}


def main() -> None:
    args = parse_args()
    placement = configure_threads(args.threads, args.bind)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_qwen3(Path(tmp) / "qwen3")
        for kind in args.kind:
            dtype = "float32" if kind == "q4" else "bfloat16"
            facts = machine_facts(dtype, args.threads)
            print(facts_line(facts), "|", placement)
            model = write_q4_gguf(folder, Path(tmp) / "qwen3-q4_0.gguf") if kind == "q4" \
                else folder
            engine = build_engine(str(model), dtype, max(args.batch), {})
            fused = engine.runner.decode_step.fused_layers
            if fused is None:
                print(f"{kind}: the C++ decode layers do not cover this model here; skipped")
                continue
            for batch in args.batch:
                result = compare(engine, batch, args)
                ms = result["ms_per_step"]
                print(f"{kind} batch {batch}: fused {ms['fused']['median']:.2f} ms/step (best "
                      f"{ms['fused']['best']:.2f}) | region {ms['region']['median']:.2f} (best "
                      f"{ms['region']['best']:.2f}) | region/fused "
                      f"{result['ratio_region_over_fused']:.2f}")
                results[f"{kind}/{batch}"] = result
    write_json(args.json, {"threads": args.threads}, {"batches": results})


if __name__ == "__main__":
    main()
