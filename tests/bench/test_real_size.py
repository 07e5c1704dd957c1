"""`bench/real_size.py`'s arithmetic: the weight bytes a format reads per token (the bandwidth
floor's numerator), the parameter count of its shape, its prompts, and the targets' verdicts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.real_size import build_runs
from bench.real_size_model import PROMPT_VOCAB, Shape, folder_weight_bytes, gguf_weight_bytes
from bench.real_size_table import Floor, Target, table, targets

TINY = Shape(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32, vocab=256)


def test_shape_counts_the_parameters_transformers_makes_and_the_folder_holds_them_once(
        tmp_path: Path) -> None:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(hidden_size=TINY.hidden, intermediate_size=TINY.intermediate,
                         num_hidden_layers=TINY.layers, num_attention_heads=TINY.heads,
                         num_key_value_heads=TINY.kv_heads, head_dim=TINY.head_dim,
                         vocab_size=TINY.vocab, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())  # the tied table once
    assert TINY.parameters() == parameters
    model.save_pretrained(tmp_path)
    assert folder_weight_bytes(tmp_path) == 2 * parameters


def write_gguf(path: Path, untied: bool) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_tensor("token_embd.weight", np.zeros((100, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((32, 32), dtype=np.float32))
    if untied:
        writer.add_tensor("output.weight", np.zeros((100, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("untied", [False, True])
def test_gguf_bytes_read_a_token_count_the_embedding_table_as_the_head_reads_it(
        tmp_path: Path, untied: bool) -> None:
    """Tied: the table is the head and is read whole. Untied: the head is, and of the table a
    token reads one row."""
    path = tmp_path / "m.gguf"
    write_gguf(path, untied)
    table_bytes, row, layer = 100 * 32 * 4, 32 * 4, 32 * 32 * 4
    expected = layer + (table_bytes + row if untied else table_bytes)
    assert gguf_weight_bytes(path) == expected


def test_every_row_has_its_own_ordinary_token_prompts() -> None:
    runs = build_runs(["bf16", "q8_0"], quick=True, seed=0)
    assert [(r.key, len(r.prompts), r.max_tokens) for r in runs] == [
        ("bf16 x1", 2, 64), ("bf16 x16", 16, 64), ("q8_0 x1", 2, 64), ("q8_0 x16", 16, 64)]
    firsts = [tuple(r.prompts[0]) for r in runs]
    assert len(set(firsts)) == len(firsts)
    ids = [t for r in runs for p in [*r.prompts, *r.warmup] for t in p]
    assert all(len(p) == 128 for r in runs for p in r.prompts)
    assert 100 <= min(ids) and max(ids) < PROMPT_VOCAB  # no control or padding tokens


def cell(tok_s: float, ttft_ms: float, tpot_ms: float) -> dict[str, float]:
    return {"output_tok_s": tok_s, "ttft_p50_s": ttft_ms / 1000, "tpot_mean_s": tpot_ms / 1000,
            "other_load_during_pct": 0.0}


FIGURES = {
    "bf16 x1": {"switchyard": cell(10, 100, 50), "llama": cell(8, 200, 60)},
    "bf16 x16": {"switchyard": cell(100, 900, 80), "llama": cell(50, 2000, 90)},
    "q4_k_m x1": {"switchyard": cell(30, 130, 20), "llama": cell(30, 150, 18)},
    "q4_k_m x16": {"switchyard": cell(90, 800, 70), "llama": {"error": "failed: boom"}},
}
FLOORS = {"bf16": Floor(3_000_000_000, 75.0), "q4_k_m": Floor(1_000_000_000, 75.0)}


def test_targets_say_met_missed_or_na_from_the_figures() -> None:
    lines = [t.line() for t in targets(["bf16", "q4_k_m"], FIGURES, FLOORS)]
    assert lines == [
        "- bf16, batch-1 decode, Switchyard / llama-server: 1.20x (target >= 1): met",
        "- bf16, batch-1 TPOT / floor: 1.25x (target <= 1.25): met",  # floor 40 ms
        "- q4_k_m, batch-1 decode, Switchyard / llama-server: 0.90x (target >= 1): MISSED",
        "- q4_k_m, batch-1 TPOT / floor: 1.50x (target <= 1.25): MISSED",  # floor 13.3 ms
        "- q4_k_m, 16 streams, Switchyard tok/s / Switchyard bf16: 0.90x (target >= 1): MISSED",
        "- q4_k_m, 16 streams, Switchyard / llama-server tok/s: n/a (target >= 1.5)",
        "- q4_k_m, prefill (TTFT p50, 128 tokens) / Switchyard bf16: 1.30x (target <= 1.2): "
        "MISSED",
    ]
    assert Target("x", 1.2, 1.2, at_least=False).line().endswith(": met")


def test_table_rows_carry_the_floor_the_ratios_and_failures() -> None:
    lines = table(["bf16", "q4_k_m"], ["switchyard", "vllm", "llama"], FIGURES, FLOORS)
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert rows[0] == ("| bf16 | Switchyard | 3.00 GB | 40.0 ms | 50.0 ms | 1.25x | 100 ms | "
                       "100.0 |  |  |")
    assert rows[1] == ("| bf16 | llama.cpp | 3.00 GB | 40.0 ms | 60.0 ms | 1.50x | 200 ms | "
                       "50.0 | 1.20x, 2.00x | 0.50x |")
    assert rows[3].endswith("| 18.0 ms | 1.35x | 150 ms | failed | 0.90x, n/a | 0.87x |")
    assert len(rows) == 4  # vLLM ran on neither format here: no row
    assert "llama.cpp, q4_k_m x16: failed: boom" in lines
