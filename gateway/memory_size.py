"""Memory sizes as people write them: bytes, a fraction of free memory, or 8GiB / 512M."""

from __future__ import annotations

import re
from typing import Any

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def parse_memory(value: Any) -> float | None:
    """Bytes (> 1) or a fraction of free memory (<= 1); strings may carry K/M/G/T[i][B]."""
    if value is None or isinstance(value, int | float):
        return None if value is None else float(value)
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"not a memory size: {value!r} (examples: 0.9, 8GiB, 512M)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return number * _UNITS[unit]
