"""One streaming load client for every engine (`bench/compare.py`): POST /v1/completions with
`stream: true`, `ignore_eos: true`, a fixed `max_tokens`, temperature 0, at most `concurrency`
requests in flight (a semaphore), and vLLM `bench serve`'s metrics.

A request's output tokens are the usage chunk's `completion_tokens` (`stream_options:
{"include_usage": true}`); every request must produce exactly `max_tokens`, or the run fails.

The client is aiohttp, as in vLLM's `bench serve`: it runs on the engines' cores, and per
W1 x64 run (4096 chunks) it took 0.21-0.22 s of CPU where httpx took 0.56-0.64 s.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

Prompt = str | list[int]


class LoadError(RuntimeError):
    """A request failed or an engine returned another number of tokens than asked."""


@dataclass
class RequestTrace:
    """One streamed request: send time, arrival of each chunk with text, tokens by usage."""

    sent: float
    arrivals: list[float] = field(default_factory=list)
    output_tokens: int | None = None  # the usage chunk's completion_tokens
    finish_reason: str | None = None

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def latency(self) -> float:
        return self.arrivals[-1] - self.sent

    @property
    def tpot(self) -> float | None:
        """vLLM's TPOT: (latency - TTFT) / (output tokens - 1)."""
        tokens = self.output_tokens or 0
        return (self.latency - self.ttft) / (tokens - 1) if tokens > 1 else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@dataclass(frozen=True)
class LoadResult:
    """A timed run: all traces, and the wall time from first send to last completion."""

    traces: list[RequestTrace]
    seconds: float

    def metrics(self) -> dict[str, Any]:
        """vLLM bench-serve figures: output tok/s, TTFT p50/p99/mean, ITL mean, TPOT mean (in
        s). The mean beside the p50: requests that come in waves put the p50 on a wave's edge."""
        ttfts = sorted(t.ttft for t in self.traces)
        gaps = [g for t in self.traces for g in t.gaps()]
        tpots = [x for t in self.traces if (x := t.tpot) is not None]
        output = sum(t.output_tokens or 0 for t in self.traces)
        return {
            "requests": len(self.traces),
            "output_tokens": output,
            "seconds": self.seconds,
            "output_tok_s": output / self.seconds,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_mean_s": statistics.fmean(ttfts) if ttfts else float("nan"),
            "itl_mean_s": statistics.fmean(gaps) if gaps else float("nan"),
            "tpot_mean_s": statistics.fmean(tpots) if tpots else float("nan"),
            "chunks_per_token": sum(len(t.arrivals) for t in self.traces) / max(output, 1),
        }

    def raw(self) -> dict[str, list[float]]:
        """Per request, in send order: TTFT and latency (s)."""
        return {"ttft_s": [t.ttft for t in self.traces],
                "latency_s": [t.latency for t in self.traces]}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of sorted `values`."""
    if not values:
        return float("nan")
    pos = (len(values) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (pos - low)


def request_body(model: str, prompt: Prompt, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
        "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True},
    }


async def stream_one(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                     ) -> RequestTrace:
    """One streamed completion; a chunk counts as a token arrival when it carries text."""
    trace = RequestTrace(sent=time.perf_counter())
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            detail = (await resp.read()).decode(errors="replace")[:300]
            raise LoadError(f"HTTP {resp.status}: {detail}")
        async for raw in resp.content:  # one line at a time
            if not raw.startswith(b"data:"):
                continue
            data = raw[5:].strip()
            if data == b"[DONE]":
                break
            _record_chunk(trace, json.loads(data))
    if trace.output_tokens is None:
        raise LoadError("no usage chunk in the stream (stream_options.include_usage ignored)")
    if not trace.arrivals:
        raise LoadError("no text chunk in the stream")
    return trace


def _record_chunk(trace: RequestTrace, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        raise LoadError(f"error in stream: {chunk['error']}")
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            trace.arrivals.append(time.perf_counter())
        if choice.get("finish_reason"):
            trace.finish_reason = choice["finish_reason"]
    if chunk.get("usage"):
        trace.output_tokens = chunk["usage"]["completion_tokens"]


async def run_load_async(url: str, model: str, prompts: list[Prompt], max_tokens: int,
                         concurrency: int, timeout_s: float) -> LoadResult:
    gate = asyncio.Semaphore(concurrency)
    # A connection per request: llama-server closes a streamed response's connection, and
    # aiohttp would write the next request into it.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async def one(prompt: Prompt) -> RequestTrace:
            async with gate:
                return await stream_one(session, url, request_body(model, prompt, max_tokens))

        start = time.perf_counter()
        traces = await asyncio.gather(*(one(p) for p in prompts))
        seconds = time.perf_counter() - start
    return LoadResult(list(traces), seconds)


def run_load(url: str, model: str, prompts: list[Prompt], max_tokens: int, concurrency: int,
             timeout_s: float = 1800) -> LoadResult:
    """Send every prompt (at most `concurrency` in flight) and check each got `max_tokens`."""
    result = asyncio.run(
        run_load_async(url, model, prompts, max_tokens, concurrency, timeout_s))
    wrong = [(i, t.output_tokens) for i, t in enumerate(result.traces)
             if t.output_tokens != max_tokens]
    if wrong:
        raise LoadError(f"{len(wrong)}/{len(prompts)} requests did not return {max_tokens} "
                        f"tokens (request, tokens): {wrong[:5]}")
    return result
