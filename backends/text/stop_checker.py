"""Stop strings over a stream of text deltas, never emitting a partial stop.

The request stops at the stop occurrence that completes first in the text (earliest end; the
longest one on a tie), whatever the split into deltas. The stop string itself is not emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopChecker:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that completed, once one has

    def feed(self, delta: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string has completed)."""
        if self.stopped:
            return "", True
        buffer = self._held + delta
        found = self._first_stop(buffer)
        if found is not None:
            cut, self.matched = found
            self.stopped = True
            self._held = ""
            return buffer[:cut], True
        keep = self._partial_stop_length(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep], False

    def flush(self) -> str:
        """The held-back text, at the end of a request that did not stop on a string."""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the first-completing stop in `text`, if any."""
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_stop_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
