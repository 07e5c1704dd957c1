"""`bench/compare.py`'s figures: rounds combined into one cell per engine and row, the Markdown
table with Switchyard's ratios, and each round's ratios."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, Protocol

LABELS = {"switchyard": "Switchyard", "vllm": "vLLM", "llama": "llama.cpp"}
SHORT = {"switchyard": "SY", "vllm": "vLLM", "llama": "llama"}
MEDIAN_KEYS = ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "itl_mean_s",
               "tpot_mean_s")

Figures = dict[str, dict[str, Any]]  # run key -> engine -> metrics or {"error": ...}


class Row(Protocol):
    key: str
    workload: str
    concurrency: int


def combine_rounds(rounds: list[Figures]) -> Figures:
    """One cell per (row, engine): a single round's as it is; several rounds' median of each
    figure, every round's cell kept under "rounds". A failed round fails the cell."""
    if len(rounds) == 1:
        return rounds[0]
    combined: Figures = {}
    for key in rounds[0]:
        combined[key] = {}
        for engine in rounds[0][key]:
            cells = [r[key][engine] for r in rounds if engine in r.get(key, {})]
            errors = [c["error"] for c in cells if "error" in c]
            if errors:
                combined[key][engine] = {"error": errors[0], "rounds": cells}
                continue
            median = {k: statistics.median(c[k] for c in cells) for k in MEDIAN_KEYS}
            combined[key][engine] = {
                **median, "noisy": any(c.get("noisy") for c in cells),
                "other_load_during_pct": max(c["other_load_during_pct"] for c in cells),
                "rounds": cells,
            }
    return combined


def table(runs: Sequence[Row], engines: list[str], figures: Figures) -> list[str]:
    """One Markdown table: per engine tok/s, TTFT p50, ITL; then Switchyard's ratios."""
    peer_list = _peers(engines)
    head = ["workload", "streams"]
    for e in engines:
        head += [f"{SHORT[e]} tok/s", f"{SHORT[e]} TTFT p50", f"{SHORT[e]} ITL"]
    for p in peer_list:
        head += [f"SY/{SHORT[p]} tok/s", f"SY/{SHORT[p]} TTFT"]
    rows = [head, ["---"] * len(head)]
    notes: list[str] = []
    for run in runs:
        cells = [run.workload, str(run.concurrency)]
        cell_of = figures[run.key]
        for e in engines:
            m = cell_of.get(e)
            if m is None:
                cells += ["n/a", "", ""]
            elif "error" in m:
                cells += ["failed", "", ""]
                notes.append(f"{LABELS[e]}, {run.key}: {m['error']}")
            else:
                mark = "*" if m.get("noisy") else ""
                cells += [f"{m['output_tok_s']:.1f}{mark}", f"{m['ttft_p50_s'] * 1000:.0f} ms",
                          f"{m['itl_mean_s'] * 1000:.1f} ms"]
                if mark:
                    notes.append(f"* {LABELS[e]}, {run.key}: other processes took "
                                 f"{m['other_load_during_pct']:.0f}% of the machine during the "
                                 f"run")
        for p in peer_list:
            cells += ratios(cell_of.get("switchyard"), cell_of.get(p))
        rows.append(cells)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("SY/peer tok/s > 1: Switchyard faster; SY/peer TTFT < 1: Switchyard answers "
                 "sooner. ITL: mean gap between token chunks.")
    return lines + sorted(set(notes), key=notes.index)


def round_ratios(runs: Sequence[Row], engines: list[str], rounds: list[Figures]) -> list[str]:
    """Switchyard's ratios to each peer in every round, one line per row and peer."""
    lines = ["ratios by round (tok/s, TTFT p50):"]
    for run in runs:
        for p in _peers(engines):
            each = [ratios(r[run.key].get("switchyard"), r[run.key].get(p)) for r in rounds]
            if all(cell != ["n/a", "n/a"] for cell in each):
                lines.append(f"  {run.key}, SY/{SHORT[p]}: "
                             + "; ".join(f"{tok} {ttft}" for tok, ttft in each))
    return lines


def ratios(sy: dict[str, Any] | None, peer: dict[str, Any] | None) -> list[str]:
    if not sy or not peer or "error" in sy or "error" in peer:
        return ["n/a", "n/a"]
    return [f"{sy['output_tok_s'] / peer['output_tok_s']:.2f}x",
            f"{sy['ttft_p50_s'] / peer['ttft_p50_s']:.2f}x"]


def _peers(engines: list[str]) -> list[str]:
    return [e for e in engines if e != "switchyard"] if "switchyard" in engines else []
