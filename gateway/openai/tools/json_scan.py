"""An incremental JSON checker: one character at a time, with the events a call reader needs.

It accepts exactly RFC 8259 text (one value) and reports, for values and object keys, where
they start and end and at which nesting depth, so a reader can cut a member's raw text out
of the stream while it is still arriving.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, auto

_WS = " \t\n\r"
_NUMBER_CHARS = frozenset("+-0123456789.eE")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_HEX = frozenset("0123456789abcdefABCDEF")
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _S(Enum):
    VALUE = auto()  # a value must come (top level, after ':' or after ',' in an array)
    ARRAY_FIRST = auto()  # after '[': a value or ']'
    OBJECT_FIRST = auto()  # after '{': a key or '}'
    KEY = auto()  # after ',' in an object: a key
    COLON = auto()
    AFTER = auto()  # after a value: ',' or the container's end
    STRING = auto()
    ESCAPE = auto()
    UNICODE = auto()
    NUMBER = auto()
    LITERAL = auto()
    DONE = auto()


@dataclass(frozen=True)
class Event:
    """`kind`: "start" (a value begins at `pos`), "end" (a value ends just before `pos`),
    "keystart" / "key" (an object key's opening / closing quote is at `pos`); `depth`: the
    containers around it."""

    kind: str
    depth: int
    pos: int


class JsonScanner:
    def __init__(self) -> None:
        self.pos = 0  # characters accepted so far
        self.failed = False
        self._stack: list[str] = []  # "{" / "["
        self._state = _S.VALUE
        self._is_key = False
        self._hex_left = 0
        self._token = ""  # the number or literal read so far
        self._literal = ""

    @property
    def done(self) -> bool:
        return self._state is _S.DONE

    @property
    def depth(self) -> int:
        return len(self._stack)

    def push(self, ch: str) -> list[Event] | None:
        """Accept `ch`: the events it caused, or None when it cannot continue the text."""
        if self.failed or self.done:
            self.failed = True
            return None
        events: list[Event] = []
        if not self._step(ch, events):
            self.failed = True
            return None
        self.pos += 1
        return events

    def _step(self, ch: str, events: list[Event]) -> bool:
        state = self._state
        if state is _S.STRING:
            return self._string(ch, events)
        if state is _S.ESCAPE:
            if ch == "u":
                self._state, self._hex_left = _S.UNICODE, 4
            elif ch in '"\\/bfnrt':
                self._state = _S.STRING
            else:
                return False
            return True
        if state is _S.UNICODE:
            if ch not in _HEX:
                return False
            self._hex_left -= 1
            if self._hex_left == 0:
                self._state = _S.STRING
            return True
        if state is _S.NUMBER:
            if ch in _NUMBER_CHARS:
                self._token += ch
                return True
            if not _NUMBER.fullmatch(self._token):
                return False
            self._end_value(events)  # the number ended before this character
            return self._step(ch, events)
        if state is _S.LITERAL:
            self._token += ch
            if not self._literal.startswith(self._token):
                return False
            if self._token == self._literal:
                self._end_value(events, after=1)
            return True
        if ch in _WS:
            return state is not _S.DONE
        return self._structural(ch, events)

    def _structural(self, ch: str, events: list[Event]) -> bool:
        state = self._state
        if state in (_S.VALUE, _S.ARRAY_FIRST):
            if state is _S.ARRAY_FIRST and ch == "]":
                return self._close("[", events)
            return self._start_value(ch, events)
        if state in (_S.OBJECT_FIRST, _S.KEY):
            if state is _S.OBJECT_FIRST and ch == "}":
                return self._close("{", events)
            if ch != '"':
                return False
            events.append(Event("keystart", self.depth, self.pos))
            self._state, self._is_key = _S.STRING, True
            return True
        if state is _S.COLON:
            if ch != ":":
                return False
            self._state = _S.VALUE
            return True
        if state is _S.AFTER:
            if ch == ",":
                self._state = _S.KEY if self._stack[-1] == "{" else _S.VALUE
                return True
            return self._close({"}": "{", "]": "["}.get(ch, ""), events)
        return False

    def _start_value(self, ch: str, events: list[Event]) -> bool:
        events.append(Event("start", self.depth, self.pos))
        if ch in "{[":
            self._stack.append(ch)
            self._state = _S.OBJECT_FIRST if ch == "{" else _S.ARRAY_FIRST
        elif ch == '"':
            self._state, self._is_key = _S.STRING, False
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self._state, self._token = _S.NUMBER, ch
        elif ch in _LITERALS:
            self._state, self._token, self._literal = _S.LITERAL, ch, _LITERALS[ch]
        else:
            return False
        return True

    def _string(self, ch: str, events: list[Event]) -> bool:
        if ch == "\\":
            self._state = _S.ESCAPE
        elif ch == '"':
            if self._is_key:
                events.append(Event("key", self.depth, self.pos))
                self._state = _S.COLON
            else:
                self._end_value(events, after=1)
        elif ord(ch) < 0x20:
            return False
        return True

    def _close(self, opener: str, events: list[Event]) -> bool:
        if not opener or not self._stack or self._stack[-1] != opener:
            return False
        self._stack.pop()
        self._end_value(events, after=1)
        return True

    def _end_value(self, events: list[Event], after: int = 0) -> None:
        events.append(Event("end", self.depth, self.pos + after))
        self._state = _S.AFTER if self._stack else _S.DONE
