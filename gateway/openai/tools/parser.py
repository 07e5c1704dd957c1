"""Tool calls out of generated text, whole or as it streams.

Text outside calls is content and leaves at once (only a possible partial marker is held
back). Inside a call the id, type and name leave as soon as the name is known, then the
arguments' raw text as it arrives: the fragments of a call concatenate to exactly its final
`arguments`. Text that turns out not to be a call (no JSON object after the marker, an
undeclared name, a syntax error before the name was announced) is content; a call that
breaks after it was announced ends there, the rest being content.
"""

from __future__ import annotations

import json
import secrets
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.tools.call_reader import CallReader

_WS = " \t\n\r"
_HERMES_CLOSE = "</tool_call>"
_MISTRAL_ARGS = "[ARGS]"


@dataclass
class ToolDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Syntax:
    """How a format writes calls: markers in the text, or a bare call opening the output."""

    markers: dict[str, str]  # marker -> region ("hermes", "llama", "mistral")
    start: dict[str, str]  # first non-space character of the output -> region


SYNTAXES = {
    "hermes": Syntax({"<tool_call>": "hermes"}, {}),
    "llama3_json": Syntax({"<|python_tag|>": "llama"}, {"{": "llama"}),
    # `[TOOL_CALLS]` is a special token that decoding may drop: a bare array also counts.
    "mistral": Syntax({"[TOOL_CALLS]": "mistral"}, {"[": "array"}),
    "forced": Syntax({}, {"[": "array"}),  # the JSON array the forced-call grammar allows
}


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ToolCallParser:
    def __init__(self, syntax: str, names: Collection[str]) -> None:
        self.syntax = SYNTAXES[syntax]
        self.names = frozenset(names)
        self.calls: list[dict[str, Any]] = []
        self._queue: deque[str] = deque()
        self._out = ToolDelta()
        self._state = "start" if self.syntax.start else "content"
        self._region = ""
        self._pending: list[str] = []  # content not yet handed out, by character
        self._scan_from = 0  # markers in _pending may only start here (text put back)
        self._quiet = True  # at the start or after a call: whitespace alone is no content
        self._raw = ""  # the region's text since it began or since its last call
        self._keep = 0  # leading characters of _raw (a marker) never scanned again
        self._tag = ""  # a closing tag or a Mistral name being read
        self._reader: CallReader | None = None
        self._current: dict[str, Any] | None = None  # the announced call being read

    # ---- public -------------------------------------------------------------------------

    def feed(self, text: str) -> ToolDelta:
        self._out = ToolDelta()
        self._queue.extend(text)
        self._run()
        self._send_arguments()
        self._send_content(final=False)
        return self._out

    def finish(self) -> ToolDelta:
        self._out = ToolDelta()
        while self._state not in ("content", "start"):
            if self._current is not None:
                self._close_call()  # cut short: its arguments as far as they came
                self._enter_content(requeue="")
            elif self._state == "close":
                self._enter_content(requeue="")
            else:
                self._give_up("")
            self._run()
        if self._state == "start":
            self._pending.extend(self._raw)
        self._send_content(final=True)
        return self._out

    # ---- the state machine --------------------------------------------------------------

    def _run(self) -> None:
        while self._queue:
            ch = self._queue.popleft()
            getattr(self, "_on_" + self._state)(ch)

    def _on_start(self, ch: str) -> None:
        if ch in _WS:
            self._raw += ch
            return
        lead, region = self._raw, self.syntax.start.get(ch)
        if region is None:
            self._enter_content(requeue=lead + ch)
            return
        self._begin(region, "", "open")
        self._raw = lead  # given back with the rest if this is no call after all
        if region == "array":
            self._raw += ch
        else:
            self._on_open(ch)

    def _on_content(self, ch: str) -> None:
        pending = self._pending
        pending.append(ch)
        for marker, region in self.syntax.markers.items():
            n = len(marker)
            if ch == marker[-1] and len(pending) - n >= self._scan_from and "".join(
                    pending[-n:]) == marker:
                del pending[-n:]
                self._send_content(final=True)
                self._begin(region, marker, "mistral_open" if region == "mistral" else "open")
                return

    def _on_open(self, ch: str) -> None:
        if ch in _WS:
            self._raw += ch
        elif ch == "{":
            self._reader = CallReader(self.names)
            self._state = "call"
            self._on_call(ch)
        else:
            self._give_up(ch)

    def _on_call(self, ch: str) -> None:
        reader = self._reader
        assert reader is not None
        if not reader.push(ch):
            self._give_up(ch)
            return
        if self._current is None:  # once announced, the text is never given back
            self._raw += ch
        if self._current is None and reader.ready:
            self._announce(reader)
        if self._region == "mistral_named" and reader.arguments_done and not reader.done:
            reader.push("}")
        if reader.done and self._current is None:
            self._give_up("")  # a complete object, but no name: not a call
        elif reader.done:
            self._close_call()
            self._raw, self._keep, self._tag = "", 0, ""
            if self._region == "mistral_named":
                self._enter_content(requeue="")
            else:
                self._state = "close"

    def _on_close(self, ch: str) -> None:
        """After a call: the region's separator, end, or closing tag."""
        if ch in _WS and not self._tag:
            self._raw += ch
            return
        self._raw += ch
        if self._region == "hermes":
            self._tag += ch
            if _HERMES_CLOSE.startswith(self._tag):
                if self._tag == _HERMES_CLOSE:
                    self._enter_content(requeue="")
                return
        elif self._region == "llama" and ch == ";":
            self._state, self._raw = "open", ";"
            return
        elif self._region == "array" and ch in ",]":
            if ch == ",":
                self._state, self._raw = "open", ","
            else:
                self._enter_content(requeue="")
            return
        self._enter_content(requeue=self._raw)  # not the region's syntax: plain text again

    def _on_mistral_open(self, ch: str) -> None:
        if ch in _WS:
            self._raw += ch
        elif ch == "[":
            self._region, self._state = "array", "open"
            self._raw += ch
        elif ch.isalnum() or ch in "_-":
            self._state, self._tag = "mistral_name", ch
            self._raw += ch
        else:
            self._give_up(ch)

    def _on_mistral_name(self, ch: str) -> None:
        """`name[ARGS]{...}`: the newer Mistral format."""
        name, bracket, tag = self._tag.partition("[")
        if bracket:
            fits = _MISTRAL_ARGS.startswith("[" + tag + ch)
        else:
            fits = ch == "[" or ch.isalnum() or ch in "_-"
        if not fits:
            self._give_up(ch)
            return
        self._tag += ch
        self._raw += ch
        if self._tag.endswith(_MISTRAL_ARGS):
            if name not in self.names:
                self._give_up("")
                return
            self._reader = CallReader(self.names)
            for c in '{"name": ' + json.dumps(name) + ', "arguments": ':
                self._reader.push(c)
            self._region, self._state = "mistral_named", "call"

    # ---- transitions --------------------------------------------------------------------

    def _begin(self, region: str, marker: str, state: str) -> None:
        self._region, self._state = region, state
        self._raw, self._keep, self._tag = marker, len(marker), ""

    def _enter_content(self, requeue: str) -> None:
        self._state, self._raw, self._keep, self._tag = "content", "", 0, ""
        self._reader = None
        self._queue.extendleft(reversed(requeue))

    def _give_up(self, ch: str) -> None:
        """`ch` broke the region: what was read becomes content (scanned again after the
        marker), unless a call was announced, which then ends where it stands."""
        if self._current is not None:
            self._close_call()
            self._enter_content(requeue=ch)
            return
        raw, keep = self._raw, self._keep
        if keep:
            self._pending.extend(raw[:keep])
            self._scan_from = len(self._pending)
        self._enter_content(requeue=raw[keep:] + ch)

    def _announce(self, reader: CallReader) -> None:
        index = len(self.calls)
        self._current = {"id": new_call_id(), "index": index, "name": reader.name, "sent": 0}
        self._out.tool_calls.append({
            "index": index, "id": self._current["id"], "type": "function",
            "function": {"name": reader.name, "arguments": ""},
        })

    def _close_call(self) -> None:
        reader, current = self._reader, self._current
        if reader is not None and current is None and reader.ready:
            self._announce(reader)
            current = self._current
        self._send_arguments()
        if reader is None or current is None:
            return
        self.calls.append({"id": current["id"], "type": "function", "function": {
            "name": current["name"], "arguments": reader.arguments()}})
        self._current, self._quiet = None, True

    # ---- output -------------------------------------------------------------------------

    def _send_arguments(self) -> None:
        current, reader = self._current, self._reader
        if current is None or reader is None:
            return
        new = reader.arguments(skip=current["sent"])
        if new:
            self._out.tool_calls.append(
                {"index": current["index"], "function": {"arguments": new}})
            current["sent"] += len(new)

    def _send_content(self, final: bool) -> None:
        """Hand out pending content; unless `final`, keep what may begin a marker."""
        pending = self._pending
        cut = len(pending) if final else len(pending) - self._held()
        text = "".join(pending[:cut])
        if self._quiet and not text.strip(_WS):
            if final:  # whitespace around calls is not content
                pending.clear()
                self._scan_from = 0
            return
        self._out.content += text
        del pending[:cut]
        self._quiet = False
        self._scan_from = max(0, self._scan_from - cut)

    def _held(self) -> int:
        """Length of the longest end of the pending text that may begin a marker."""
        longest = 0
        for marker in self.syntax.markers:
            most = min(len(marker) - 1, len(self._pending) - self._scan_from)
            tail = "".join(self._pending[len(self._pending) - most:]) if most > 0 else ""
            for n in range(len(tail), 0, -1):
                if marker.startswith(tail[-n:]):
                    longest = max(longest, n)
                    break
        return longest
