"""Reads one call object, `{"name": ..., "arguments": {...}}`, as its text arrives.

The arguments' raw text is available while it streams (`arguments()` only ever grows), so
the parser can hand out fragments that concatenate to exactly the final arguments string.
"""

from __future__ import annotations

import json
from collections.abc import Collection

from gateway.openai.tools.json_scan import JsonScanner

ARGUMENT_KEYS = ("arguments", "parameters")  # Llama 3 says "parameters"
_KNOWN_KEYS = frozenset({"name", "type", "id", *ARGUMENT_KEYS})


class CallReader:
    """Feed characters with `push`; `failed` once the text cannot be a call to one of
    `names`. `ready` once the name is known and the arguments can start streaming."""

    def __init__(self, names: Collection[str]) -> None:
        self.names = names
        self._chars: list[str] = []  # the text read so far (a list: it can grow long)
        self.name: str | None = None
        self.failed = False
        self._scanner = JsonScanner()
        self._key: str | None = None
        self._key_start = 0
        self._value_start: int | None = None
        self._args: tuple[int, int | None] | None = None  # raw span of an object value
        self._decoded_args: str | None = None  # arguments given as a JSON string

    @property
    def done(self) -> bool:
        return self._scanner.done and not self.failed

    @property
    def arguments_done(self) -> bool:
        return self._decoded_args is not None or (
            self._args is not None and self._args[1] is not None)

    @property
    def ready(self) -> bool:
        """The call can be announced: its name is known and its arguments have begun."""
        if self.failed or self.name is None:
            return False
        return self._args is not None or self._decoded_args is not None or self.done

    def arguments(self, skip: int = 0) -> str:
        """The arguments text so far, less its first `skip` characters (all of it once
        `arguments_done`; "{}" when there are none)."""
        if self._decoded_args is not None:
            return self._decoded_args[skip:]
        if self._args is None:
            return "{}"[skip:] if self.done else ""
        start, end = self._args
        return "".join(self._chars[start + skip:end])

    def _slice(self, start: int, end: int) -> str:
        return "".join(self._chars[start:end])

    def push(self, ch: str) -> bool:
        if self.failed:
            return False
        if self._scanner.pos == 0 and ch != "{":
            return self._fail()
        events = self._scanner.push(ch)
        if events is None:
            return self._fail()
        self._chars.append(ch)
        for event in events:
            if event.depth != 1:
                continue
            if event.kind == "keystart":
                self._key_start = event.pos
            elif event.kind == "start":
                self._value_start = event.pos
                if self._key in ARGUMENT_KEYS and ch == "{" and self._args is None:
                    self._args = (event.pos, None)
            elif event.kind == "key":
                if not self._on_key(event.pos):
                    return False
            elif event.kind == "end" and not self._on_value_end(event.pos):
                return False
        return True

    def _on_key(self, end: int) -> bool:
        self._key = json.loads(self._slice(self._key_start, end + 1))
        return self._key in _KNOWN_KEYS or self._fail()

    def _on_value_end(self, end: int) -> bool:
        start = self._value_start if self._value_start is not None else end
        raw = self._slice(start, end)
        if self._key == "name":
            return self._on_name(raw)
        if self._key in ARGUMENT_KEYS:
            if self._args is not None and self._args[1] is None:
                self._args = (self._args[0], end)
                return True
            return self._on_string_arguments(raw)
        return True

    def _on_name(self, raw: str) -> bool:
        name = json.loads(raw)
        if not isinstance(name, str) or name not in self.names or self.name is not None:
            return self._fail()
        self.name = name
        return True

    def _on_string_arguments(self, raw: str) -> bool:
        """Some models write the arguments as a JSON string holding the JSON object."""
        value = json.loads(raw)
        if not isinstance(value, str) or self.arguments_done:
            return self._fail()
        try:
            parsed = json.loads(value)
        except ValueError:
            return self._fail()
        if not isinstance(parsed, dict):
            return self._fail()
        self._decoded_args = value
        return True

    def _fail(self) -> bool:
        self.failed = True
        return False
