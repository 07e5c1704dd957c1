"""A generation's text -> the response's output items, and the stream events that build them.

One builder per response: it is fed the text as it arrives (a thinking model's split into
reasoning and content; content through the tool plan's call parser, when there is one) and
keeps the items in output order: a `reasoning` item, `message` items with one `output_text`
part, `function_call` items. A new kind of text closes the item before it. Each feed returns
the events of what it added (`response.output_item.added`, deltas, `...done`), without
sequence numbers; a whole answer is built by the same feeds, its events dropped, so it has
the items a stream of it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from backends.base import ReasoningSplit
from gateway.openai.tools import ToolCallParser
from gateway.responses_api.items import new_id

JSON = dict[str, Any]
Events = list[JSON]


def _text_part(text: str) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_part(text: str) -> JSON:
    return {"type": "reasoning_text", "text": text}


@dataclass
class _Open:
    """The item being built: its place in the output, its fixed fields, its text so far."""

    index: int
    kind: str  # "reasoning" | "message" | "function_call"
    fields: JSON
    text: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        return str(self.fields["id"])

    def where(self) -> JSON:
        return {"item_id": self.id, "output_index": self.index}

    def item(self, status: str) -> JSON:
        """The item as it stands (`status` "in_progress" while it is built)."""
        text = "".join(self.text)
        if self.kind == "reasoning":
            content = [_reasoning_part(text)] if status != "in_progress" else []
            return {**self.fields, "summary": [], "content": content}
        if self.kind == "message":
            content = [_text_part(text)] if status != "in_progress" else []
            return {**self.fields, "status": status, "content": content}
        return {**self.fields, "status": status, "arguments": text}


class OutputBuilder:
    def __init__(self, parser: ToolCallParser | None = None) -> None:
        self._parser = parser
        self.items: list[JSON] = []  # finished items, in output order
        self._open: _Open | None = None
        self._count = 0

    def feed(self, text: str, split: ReasoningSplit | None = None) -> Events:
        """The events of one piece of generated text."""
        events: Events = []
        if split is not None:
            events += self._reasoning(split.reasoning)
            text = split.content
        if self._parser is None:
            return events + self._content(text)
        delta = self._parser.feed(text)
        return events + self._content(delta.content) + self._calls(delta.tool_calls)

    def finish(self, status: str) -> Events:
        """Close the output: `status` "completed", or "incomplete" (cut at the token limit)."""
        events: Events = []
        if self._parser is not None:
            rest = self._parser.finish()
            events += self._content(rest.content) + self._calls(rest.tool_calls)
        if self._open is None and not self.items:
            events += self._start("message", {"role": "assistant"})  # an empty answer
        return events + self._close(status)

    # ---- what arrives -------------------------------------------------------------------

    def _reasoning(self, text: str) -> Events:
        if not text:
            return []
        events = [] if self._is_open("reasoning") else self._start("reasoning", {})
        return events + self._append(text, "response.reasoning_text.delta")

    def _content(self, text: str) -> Events:
        if not text:
            return []
        events = [] if self._is_open("message") else self._start("message", {"role": "assistant"})
        return events + self._append(text, "response.output_text.delta")

    def _calls(self, fragments: list[JSON]) -> Events:
        events: Events = []
        for fragment in fragments:
            function = fragment.get("function", {})
            if "id" in fragment:  # a call is announced: its name is known
                events += self._start("function_call", {"call_id": fragment["id"],
                                                        "name": function["name"]})
            if function.get("arguments") and self._is_open("function_call"):
                events += self._append(function["arguments"],
                                       "response.function_call_arguments.delta")
        return events

    # ---- items --------------------------------------------------------------------------

    def _is_open(self, kind: str) -> bool:
        return self._open is not None and self._open.kind == kind

    def _start(self, kind: str, fields: JSON) -> Events:
        events = self._close("completed")
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        head = {"id": new_id(prefix), "type": kind, **fields}
        opened = _Open(self._count, kind, head)
        self._count += 1
        self._open = opened
        events.append({"type": "response.output_item.added", "output_index": opened.index,
                       "item": opened.item("in_progress")})
        if kind == "message":
            events.append(self._part_event("response.content_part.added", opened, _text_part("")))
        elif kind == "reasoning":
            events.append(self._part_event("response.content_part.added", opened,
                                           _reasoning_part("")))
        return events

    def _append(self, text: str, event_type: str) -> Events:
        opened = self._open
        assert opened is not None
        opened.text.append(text)
        event: JSON = {"type": event_type, **opened.where(), "delta": text}
        if opened.kind != "function_call":
            event["content_index"] = 0
        if opened.kind == "message":
            event["logprobs"] = []
        return [event]

    def _close(self, status: str) -> Events:
        opened, self._open = self._open, None
        if opened is None:
            return []
        item = opened.item(status)
        self.items.append(item)
        text = "".join(opened.text)
        events: Events = []
        if opened.kind == "message":
            events.append({"type": "response.output_text.done", **opened.where(),
                           "content_index": 0, "text": text, "logprobs": []})
            events.append(self._part_event("response.content_part.done", opened, _text_part(text)))
        elif opened.kind == "reasoning":
            events.append({"type": "response.reasoning_text.done", **opened.where(),
                           "content_index": 0, "text": text})
            events.append(self._part_event("response.content_part.done", opened,
                                           _reasoning_part(text)))
        else:
            events.append({"type": "response.function_call_arguments.done", **opened.where(),
                           "name": opened.fields["name"], "arguments": text})
        events.append({"type": "response.output_item.done", "output_index": opened.index,
                       "item": item})
        return events

    @staticmethod
    def _part_event(event_type: str, opened: _Open, part: JSON) -> JSON:
        return {"type": event_type, **opened.where(), "content_index": 0, "part": part}
