"""What a running gateway's /metrics exposes, and which metrics a PromQL expression reads.

Shared by the Grafana dashboard and Kubernetes (HPA) tests. A gateway is an in-process app
(echo backends, no model) served by uvicorn on a free port, with API keys on (an admin key and
a real redis-server), after a little traffic: a streamed chat, a TGI /generate and a request
refused by a key's requests-per-minute limit, so labelled series have samples.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from backends.base import GenerationEvent, GenerationRequest, RequestTimings, StepTiming
from gateway.app import create_app
from gateway.settings import Settings
from tests.auth.conftest import RedisServer
from tests.gateway.conftest import running_server
from tests.gateway.echo_backend import EchoBackend

# Labels Prometheus itself adds at scrape time (never in the exposition).
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "container", "service",
                           "node", "endpoint"})
_SUFFIXES = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("", "_sum", "_count"),
             "counter": ("_total",), "gauge": ("",)}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?[ \t]+\S+", re.MULTILINE)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass
class Exposition:
    """The series names a Prometheus scrape of /metrics would store, and their labels."""

    text: str
    types: dict[str, str] = field(default_factory=dict)  # family -> counter | gauge | ...
    series: set[str] = field(default_factory=set)  # every queryable name
    labels: dict[str, set[str]] = field(default_factory=dict)  # series -> label names seen
    label_values: dict[tuple[str, str], set[str]] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Exposition:
        out = cls(text)
        # HELP / TYPE lines name every family, labelled ones without samples included.
        for match in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
            name, kind = match.groups()
            out.types[name] = kind
            base = name.removesuffix("_total") if kind == "counter" else name
            out.series.update(base + s for s in _SUFFIXES.get(kind, ("",)))
            if kind == "counter":
                out.series.add(name)  # exact names (tgi_request_count) and `_total` ones alike
        # Samples as Prometheus stores them (prometheus_client's own parser renames exact
        # counters such as tgi_request_failure to `_total`, which Prometheus does not).
        for match in _SAMPLE.finditer(text):
            name, labels = match.group(1), dict(_LABEL.findall(match.group(2) or ""))
            out.series.add(name)
            out.labels.setdefault(name, set()).update(labels)
            for key, value in labels.items():
                out.label_values.setdefault((name, key), set()).add(value)
        return out


ADMIN_KEY = "sy-admin-" + secrets.token_urlsafe(24)


@dataclass
class TimedEchoBackend(EchoBackend):
    """The echo backend, plus what the native engine also reports: each finished request's
    queue / inference timings and the engine steps' timings (tgi_request_queue_duration,
    tgi_batch_forward_duration...)."""

    steps: list[StepTiming] = field(default_factory=list)

    async def _generate(self, req: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        self.steps.append(StepTiming("prefill", 0.002, 1))
        async for event in super()._generate(req):
            if event.finish_reason is not None:
                self.steps.append(StepTiming("decode", 0.001, 1))
                event = replace(event, timings=RequestTimings(0.001, 0.004))
            yield event

    def drain_step_timings(self) -> list[StepTiming]:
        steps, self.steps = self.steps, []
        return steps


@contextmanager
def traffic_gateway(folder: Path) -> Iterator[tuple[str, Exposition]]:
    """A gateway with keys on, after some traffic; yields (base URL, its /metrics)."""
    redis = RedisServer(folder)
    redis.start()
    try:
        settings = Settings(admin_key=ADMIN_KEY, redis_url=redis.url)
        app = create_app(settings, backends={"echo": TimedEchoBackend(name="echo")})
        with running_server(app) as url, httpx.Client(base_url=url, timeout=10) as http:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            made = http.post("/admin/keys", json={"name": "dash", "rpm": 2}, headers=admin)
            assert made.status_code == 201, made.text
            user = {"Authorization": f"Bearer {made.json()['key']}"}
            chat = {"model": "echo", "messages": [{"role": "user", "content": "one two"}],
                    "max_tokens": 4, "stream": True}
            assert http.post("/v1/chat/completions", json=chat, headers=user).status_code == 200
            generate = {"inputs": "one two", "parameters": {"max_new_tokens": 3}}
            assert http.post("/generate", json=generate, headers=user).status_code == 200
            limited = http.post("/v1/chat/completions", json=chat, headers=user)
            assert limited.status_code == 429, limited.text  # the key's rpm is spent
            assert http.get("/health").status_code == 200
            scraped = http.get("/metrics")
            assert scraped.status_code == 200
            yield url, Exposition.parse(scraped.text)
    finally:
        redis.stop()


# ---- PromQL: the metric names an expression reads --------------------------------------

_KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool",
                       "and", "or", "unless", "offset", "inf", "nan"})
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Grafana's variables, as a Prometheus would see them after interpolation.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                     "$model": ".*", "$instance": ".*"}


def interpolate(expr: str) -> str:
    for name in sorted(GRAFANA_VARIABLES, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARIABLES[name])
    assert "$" not in expr, f"an unknown Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Every metric identifier in a PromQL expression (a small lexer, no parser needed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group()
        if word.lower() in _KEYWORDS or text[match.end():].lstrip().startswith("("):
            continue  # a keyword, or a function / aggregation call
        if match.start() > 0 and (text[match.start() - 1].isdigit()
                                  or text[match.start() - 1] == "."):
            continue  # the exponent or unit of a number
        names.add(word)
    return names


def selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: matched value}) for every selector with matchers."""
    out = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        pairs = re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"',
                           match.group(2))
        out.append((match.group(1), dict(pairs)))
    return out


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)` / `without (...)` / `on (...)` / `ignoring (...)`."""
    found: set[str] = set()
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    for match in re.finditer(
            r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        found.update(x.strip() for x in match.group(1).split(",") if x.strip())
    return found
