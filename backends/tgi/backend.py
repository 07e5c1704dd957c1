"""TGIBackend: a TGI server (or Switchyard's TGI routes) through `/generate_stream`.

TGI's /generate has no chat: messages (and `tools`, as transformers passes them) are rendered
with the `tokenizer` option's chat template (without one, chat is refused with a 400 naming
the option); the gateway reads tool calls from the text, as with any backend. A request for
prompt logprobs goes to `/generate` (TGI computes them only there) and is answered whole.
A request without `max_tokens` is sent with `max_new_tokens` set to the room its prompt leaves
(what the gateway reserved), never null: TGI would take the rest of its own window.
Errors, timeouts and closing behave as in `backends.remote`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from backends.base import DeploymentError, GenerationEvent, GenerationRequest, RequestError
from backends.remote.client import UpstreamClient
from backends.remote.http import malformed, parse_json, sse_data, transport_errors
from backends.remote.upstream import UpstreamBackend
from backends.text.stop_checker import StopChecker
from backends.tgi.frames import FrameReader, prefill_tokens, whole_as_frames
from backends.tgi.options import TGIOptions
from backends.tgi.payload import build_payload


class TGIBackend(UpstreamBackend):
    kind = "tgi"
    health_path = "/health"

    def __init__(self, name: str, options: TGIOptions) -> None:
        super().__init__(name, options)
        if options.model:
            self._headers["x-model"] = options.model

    async def discover_limits(self, client: UpstreamClient) -> None:
        info = await client.get_json("/info")
        total = info.get("max_total_tokens")
        if isinstance(total, int) and total > 1:
            self.max_total_tokens = total
            limit = info.get("max_input_tokens", info.get("max_input_length"))
            self.max_input_tokens = limit if isinstance(limit, int) else total - 1

    def small_generation(self) -> tuple[str, dict[str, Any]]:
        return "/generate", {"inputs": ".", "parameters": {"max_new_tokens": 1}}

    def chat_template(self) -> str | None:
        """The `tokenizer` option's template: this backend renders chats itself."""
        tokenizer = self.counter.tokenizer
        return tokenizer.chat_template if tokenizer is not None else None

    def info_extra(self) -> dict[str, Any]:
        extra = super().info_extra()
        # TGI's details carry both counts; the counter only fills a missing input_length.
        extra["usage_source"] = "upstream"
        extra["count_source"] = self.counter.source
        return extra

    def _inputs(self, req: GenerationRequest) -> str:
        tokenizer = self.counter.tokenizer
        if tokenizer is None and req.messages is not None:
            raise RequestError(
                "chat messages need the model's chat template, and this TGI deployment has "
                "none: give its backend a `tokenizer` option, or send a text prompt",
                param="messages", code="chat_unsupported")
        if tokenizer is None and req.prompt_token_ids is not None:
            raise RequestError(
                "token id prompts need a `tokenizer` option on this TGI deployment",
                param="prompt", code="tokenizer_required")
        text = self.counter.prompt_text(req)
        bos = tokenizer.adds_bos() if tokenizer is not None else None
        if req.messages is not None and bos and text.startswith(bos):
            text = text[len(bos):]  # TGI adds BOS itself: do not send it twice
        if not text:
            raise RequestError("the prompt is empty", param="prompt")
        return text

    async def events(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        inputs = self._inputs(req)
        req = await self.bounded(req)
        body = build_payload(inputs, req.sampling)
        reader = FrameReader(req.sampling.logprobs, StopChecker(req.sampling.stop),
                             lambda: self.counter.prompt_tokens(req))
        if req.sampling.prompt_logprobs is not None:
            for event in await self._whole(body, reader):
                yield event
            return
        response = await self.client.open_stream("/generate_stream", body)
        last: GenerationEvent | None = None
        try:
            with transport_errors(self.options.base_url):
                async for data in sse_data(response, self.client.limits):
                    if last is not None:
                        continue  # read to the end: the connection stays reusable
                    event = reader.feed(parse_json(data))
                    if reader.finished:
                        last = event
                    elif event is not None:
                        yield event
            if last is None:
                raise DeploymentError("the upstream ended the stream before its last token",
                                      status_code=502, code="upstream_error")
            yield last
        finally:
            response.close()  # read to its end, the connection is back in the pool already

    async def _whole(self, body: dict[str, Any], reader: FrameReader) -> list[GenerationEvent]:
        """TGI gives the prompt's logprobs (decoder_input_details) only on `/generate`, in a
        whole answer: its tokens are replayed as stream frames, the prompt's on the first."""
        response = await self.client.open_stream("/generate", body)
        try:
            raw = await self.client.read_whole(response)
        finally:
            response.close()
        try:
            answer = json.loads(raw)
        except ValueError:
            raise malformed(f"the answer is not JSON: {raw[:200]!r}") from None
        frames = whole_as_frames(answer)
        events: list[GenerationEvent] = []
        for frame in frames:
            event = reader.feed(frame)
            if event is not None:
                events.append(event)
            if reader.finished:
                break
        prompt = prefill_tokens(frames[-1]["details"])
        return [replace(events[0], prompt_tokens=prompt), *events[1:]]
