"""How deeply a raw JSON body nests, measured on its bytes before it is parsed.

Python's parser and everything after it (pydantic, `copy.deepcopy`, schema compilers,
chat templates) recurse once or more per level, so a body is refused before parsing when it
nests deeper than `MAX_JSON_DEPTH`: a clear 400 instead of a RecursionError (a 500) in
whichever recursion gives out first. The measure is vectorised (a regex drops the strings,
numpy sums the brackets), a fraction of `json.loads`' own time on the same bytes.
"""

from __future__ import annotations

import re

import numpy as np

MAX_JSON_DEPTH = 64  # arrays and objects inside one another, the body itself being level 1
# A JSON string: quote, then runs of plain characters and escapes, then quote.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)  # what each byte does to the depth
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def nesting_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw` (brackets inside strings do not
    count; for text that is not valid JSON the answer is only approximate)."""
    if raw.count(b"[") + raw.count(b"{") <= 1:
        return min(1, raw.count(b"[") + raw.count(b"{"))
    structure = np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)
    return int(np.cumsum(_STEP[structure], dtype=np.int32).max(initial=0))


def too_deep(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `raw` nests deeper than `limit` (cheap when it holds few brackets)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return nesting_depth(raw) > limit
