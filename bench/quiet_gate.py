"""`bench/compare.py`'s quiet gate: the share of the machine that processes other than the
benched server and the bench itself take, from /proc, sampled before a timed run (wait until it
is under a threshold) and measured over it (a noisy run is timed again)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from bench import peers
from bench.compare_table import LABELS


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already in user
    return total - idle, total


def group_ticks(pgid: int) -> int:
    """utime + stime of every process in process group `pgid` (a server and its children)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if int(fields[2]) == pgid:  # pgrp
            ticks += int(fields[11]) + int(fields[12])
    return ticks


def sample_load(pgid: int | None, seconds: float = 2.0) -> tuple[float, float]:
    """(other load, the server's own load) in % of the machine over `seconds`."""
    busy0, total0 = cpu_ticks()
    own0 = group_ticks(pgid) if pgid else 0
    time.sleep(seconds)
    busy1, total1 = cpu_ticks()
    own1 = group_ticks(pgid) if pgid else 0
    total = max(total1 - total0, 1)
    own = 100 * (own1 - own0) / total
    return max(100 * (busy1 - busy0) / total - own, 0.0), own


class LoadMeter:
    """Other processes' share of the machine between construction and `other_pct()`: the
    machine's busy time minus the server's process group and this bench's own group."""

    def __init__(self, server_pgid: int) -> None:
        self.pgids = (server_pgid, os.getpgrp())
        self.start = self._snapshot()

    def _snapshot(self) -> tuple[int, int, int]:
        busy, total = cpu_ticks()
        return busy, total, sum(group_ticks(g) for g in self.pgids)

    def other_pct(self) -> float:
        busy, total, ours = (b - a for a, b in zip(self.start, self._snapshot(), strict=True))
        return max(100 * (busy - ours) / max(total, 1), 0.0)


def quiet_gate(server: peers.Server, args: argparse.Namespace) -> dict[str, float]:
    """Wait until the load of everything but this server is under the threshold."""
    start = time.monotonic()
    shown = -60.0
    while True:
        other, own = sample_load(server.proc.pid)
        waited = time.monotonic() - start
        quiet = args.no_quiet_gate or other < args.quiet_threshold
        if quiet or waited - shown >= 30:  # the first sample, then one line every 30 s
            shown = waited
            print(f"  quiet gate: other load {other:.1f}% (threshold "
                  f"{args.quiet_threshold:.0f}%{', off' if args.no_quiet_gate else ''}), idle "
                  f"{LABELS[server.name]} {own:.1f}%, waited {waited:.0f} s", flush=True)
        if quiet:
            return {"other_load_pct": other, "server_idle_pct": own, "waited_s": waited}
        if waited > args.quiet_timeout:
            raise SystemExit(f"the machine stayed busy ({other:.1f}% other load) for "
                             f"{args.quiet_timeout:.0f} s: rerun later or pass --no-quiet-gate")
        time.sleep(1)
