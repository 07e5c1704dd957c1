"""`bench/real_size.py`'s table: per format and engine, batch-1 decode (TPOT), TTFT and 16-stream
tok/s beside the format's memory-bandwidth floor, Switchyard's ratios to each peer, and the
performance targets, each marked met or missed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.compare_table import LABELS, Figures

PEER_NOTE = ("SY speed / peer: batch-1 decode as the peer's TPOT / Switchyard's and 16-stream "
             "tok/s as Switchyard's / the peer's (> 1: Switchyard faster); TTFT as Switchyard's "
             "/ the peer's (< 1: Switchyard sooner).")


@dataclass(frozen=True)
class Floor:
    """A format's batch-1 decode floor: its weight bytes read per token at the read stream's
    rate (measured in the same run)."""

    weight_bytes: int
    stream_gbs: float

    @property
    def ms(self) -> float:
        return self.weight_bytes / (self.stream_gbs * 1e9) * 1000


@dataclass(frozen=True)
class Target:
    """One performance target: a ratio and the bound it must meet."""

    what: str
    value: float | None  # None: a figure it needs is missing
    bound: float
    at_least: bool  # True: value >= bound; False: value <= bound

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        if self.value is None:
            return f"- {self.what}: n/a (target {sign} {self.bound:g})"
        met = self.value >= self.bound if self.at_least else self.value <= self.bound
        return (f"- {self.what}: {self.value:.2f}x (target {sign} {self.bound:g}): "
                f"{'met' if met else 'MISSED'}")


def cell(figures: Figures, fmt: str, streams: int, engine: str) -> dict[str, Any] | None:
    """An engine's figures for one format and concurrency; None when missing or failed."""
    found = figures.get(f"{fmt} x{streams}", {}).get(engine)
    return None if found is None or "error" in found else found


def table(formats: list[str], engines: list[str], figures: Figures,
          floors: dict[str, Floor]) -> list[str]:
    head = ["format", "engine", "weights / token", "floor", "x1 TPOT", "TPOT / floor",
            "x1 TTFT p50", "x16 tok/s", "SY speed / peer: x1, x16", "SY TTFT / peer"]
    rows = [head, ["---"] * len(head)]
    notes: list[str] = []
    for fmt in formats:
        floor = floors[fmt]
        for engine in engines:
            if not any(engine in figures.get(f"{fmt} x{s}", {}) for s in (1, 16)):
                continue  # not run on this format (vLLM serves the bf16 folder only)
            rows.append([fmt, LABELS[engine], f"{floor.weight_bytes / 1e9:.2f} GB",
                         f"{floor.ms:.1f} ms", *engine_cells(figures, fmt, engine, floor),
                         *peer_ratios(figures, fmt, engine)])
            notes += failures(figures, fmt, engine)
    lines = ["| " + " | ".join(r) + " |" for r in rows]
    lines.append("floor: weight bytes read per token / the measured read stream (batch-1 "
                 "decode can be no faster). " + PEER_NOTE)
    return lines + notes


def engine_cells(figures: Figures, fmt: str, engine: str, floor: Floor) -> list[str]:
    one, many = cell(figures, fmt, 1, engine), cell(figures, fmt, 16, engine)
    out = ["failed", "", ""] if one is None else [
        f"{one['tpot_mean_s'] * 1000:.1f} ms{mark(one)}",
        f"{one['tpot_mean_s'] * 1000 / floor.ms:.2f}x",
        f"{one['ttft_p50_s'] * 1000:.0f} ms"]
    return out + ["failed" if many is None else f"{many['output_tok_s']:.1f}{mark(many)}"]


def peer_ratios(figures: Figures, fmt: str, engine: str) -> list[str]:
    if engine == "switchyard":
        return ["", ""]
    decode = tpot_speedup(figures, fmt, engine)
    streams = tok_s_ratio(figures, fmt, engine)
    ttft = ttft_ratio(figures, fmt, "switchyard", fmt, engine)
    shown = [f"{x:.2f}x" if x is not None else "n/a" for x in (decode, streams, ttft)]
    return [f"{shown[0]}, {shown[1]}", shown[2]]


def mark(figures: dict[str, Any]) -> str:
    return "*" if figures.get("noisy") else ""


def failures(figures: Figures, fmt: str, engine: str) -> list[str]:
    notes = []
    for streams in (1, 16):
        found = figures.get(f"{fmt} x{streams}", {}).get(engine) or {}
        if "error" in found:
            notes.append(f"{LABELS[engine]}, {fmt} x{streams}: {found['error']}")
        elif found.get("noisy"):
            notes.append(f"* {LABELS[engine]}, {fmt} x{streams}: other processes took "
                         f"{found['other_load_during_pct']:.0f}% of the machine during the run")
    return notes


def tpot_speedup(figures: Figures, fmt: str, peer: str) -> float | None:
    ours, theirs = cell(figures, fmt, 1, "switchyard"), cell(figures, fmt, 1, peer)
    return theirs["tpot_mean_s"] / ours["tpot_mean_s"] if ours and theirs else None


def tok_s_ratio(figures: Figures, fmt: str, peer: str, peer_fmt: str | None = None,
                ) -> float | None:
    ours = cell(figures, fmt, 16, "switchyard")
    theirs = cell(figures, peer_fmt or fmt, 16, peer)
    return ours["output_tok_s"] / theirs["output_tok_s"] if ours and theirs else None


def ttft_ratio(figures: Figures, fmt: str, engine: str, other_fmt: str, other: str,
               ) -> float | None:
    ours, theirs = cell(figures, fmt, 1, engine), cell(figures, other_fmt, 1, other)
    return ours["ttft_p50_s"] / theirs["ttft_p50_s"] if ours and theirs else None


def targets(formats: list[str], figures: Figures, floors: dict[str, Floor]) -> list[Target]:
    """Every format at batch 1 at least llama-server's speed and within 1.25x of its floor;
    the quantized ones at 16 streams at least the bf16 path's tok/s and 1.5x llama-server's,
    their prefill (TTFT at batch 1) within 1.2x of bf16's."""
    found: list[Target] = []
    for fmt in formats:
        ours = cell(figures, fmt, 1, "switchyard")
        found.append(Target(f"{fmt}, batch-1 decode, Switchyard / llama-server",
                            tpot_speedup(figures, fmt, "llama"), 1.0, True))
        found.append(Target(f"{fmt}, batch-1 TPOT / floor",
                            ours["tpot_mean_s"] * 1000 / floors[fmt].ms if ours else None,
                            1.25, False))
    for fmt in (f for f in formats if f != "bf16"):
        found.append(Target(f"{fmt}, 16 streams, Switchyard tok/s / Switchyard bf16",
                            tok_s_ratio(figures, fmt, "switchyard", "bf16"), 1.0, True))
        found.append(Target(f"{fmt}, 16 streams, Switchyard / llama-server tok/s",
                            tok_s_ratio(figures, fmt, "llama"), 1.5, True))
        found.append(Target(f"{fmt}, prefill (TTFT p50, 128 tokens) / Switchyard bf16",
                            ttft_ratio(figures, fmt, "switchyard", "bf16", "switchyard"),
                            1.2, False))
    return found
