"""deploy/grafana/switchyard.json: a valid dashboard whose every query reads metrics that a
running gateway really exports, with labels it really sets."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.metrics import failure_kind
from tests.deploy.metrics_exposition import (
    TARGET_LABELS,
    Exposition,
    grouping_labels,
    interpolate,
    metric_names,
    selectors,
    traffic_gateway,
)

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "switchyard.json"
# What the dashboard must show (issue 14), by the series it reads.
REQUIRED = {
    "request rate by status": "switchyard_requests_total",
    "queue size": "tgi_queue_size",
    "batch size": "tgi_batch_current_size",
    "TTFT": "switchyard_time_to_first_token_seconds_bucket",
    "ITL": "switchyard_inter_token_latency_seconds_bucket",
    "end-to-end latency": "switchyard_request_duration_seconds_bucket",
    "KV cache use": "switchyard_kv_blocks_used",
    "KV cache size": "switchyard_kv_blocks_total",
    "prefix cache hits": "switchyard_prefix_cache_hits_total",
    "rate-limit rejections": "tgi_request_failure",
    "per-key usage": "switchyard_key_tokens_total",
    "per-key rate-limit rejections": "switchyard_key_rate_limited_total",
    "queue rejections": "switchyard_queue_rejections_total",
    "timeouts": "switchyard_request_timeouts_total",
    "engine step failures": "switchyard_engine_step_failures_total",
}
# Every `err` value tgi_request_failure can carry (gateway/metrics.py's failure_kind).
ERR_VALUES = {failure_kind(status, kind) for status in range(200, 600)
              for kind in (None, "overloaded", "rate_limit_error", "timeout_error")}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Exposition]:
    with traffic_gateway(tmp_path_factory.mktemp("grafana")) as (_, exposition):
        yield exposition


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
        out.append(panel)
    return [p for p in out if p["type"] not in ("row", "text")]


def _expressions(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in _panels(dashboard) for t in p["targets"]]


_LABEL_VALUES = re.compile(r"label_values\((\w+(?:\{[^}]*\})?),\s*(\w+)\)")


def _variable_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """{variable: its query}, for the query variables (Grafana's label_values(...))."""
    out = {}
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out[var["name"]] = query["query"] if isinstance(query, dict) else query
    return out


def test_the_dashboard_is_a_grafana_model(dashboard: dict[str, Any]) -> None:
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert dashboard["uid"] and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"model", "instance"} <= set(variables)
    panels = _panels(dashboard)
    assert len(panels) >= 15
    for panel in panels:
        assert panel["type"] in ("timeseries", "stat", "gauge", "bargauge", "table"), panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}"


def test_panels_lie_on_the_grid_without_overlapping(dashboard: dict[str, Any]) -> None:
    cells: set[tuple[int, int]] = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_every_queried_metric_is_exported(dashboard: dict[str, Any],
                                          exposition: Exposition) -> None:
    variables = [_LABEL_VALUES.fullmatch(q) for q in _variable_queries(dashboard).values()]
    assert all(variables)
    queries = [*_expressions(dashboard), *(m.group(1) for m in variables if m)]
    queried = set().union(*(metric_names(q) for q in queries))
    assert queried
    missing = sorted(queried - exposition.series)
    assert not missing, f"queried but not exported by /metrics: {missing}"
    for name in queried:  # a histogram's series: its family really is a histogram
        for suffix in ("_bucket", "_sum", "_count"):
            base = name.removesuffix(suffix)
            if base != name and base in exposition.types:
                assert exposition.types[base] == "histogram", name


def test_the_dashboard_covers_what_operators_need(dashboard: dict[str, Any]) -> None:
    queried = set().union(*(metric_names(e) for e in _expressions(dashboard)))
    missing = {topic: name for topic, name in REQUIRED.items() if name not in queried}
    assert not missing


def test_quantiles_read_histogram_buckets_by_le(dashboard: dict[str, Any],
                                                exposition: Exposition) -> None:
    quantiles = [e for e in _expressions(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) >= 12  # TTFT, ITL, e2e: p50 / p90 / p99 each, and more
    for expr in quantiles:
        names = metric_names(expr)
        assert names and all(n.endswith("_bucket") for n in names), expr
        assert all(exposition.types[n.removesuffix("_bucket")] == "histogram" for n in names)
        assert "le" in grouping_labels(expr), expr
        assert re.search(r"rate\([^()]*\[\$__rate_interval\]\)", expr), expr


def test_labels_in_queries_are_labels_the_metrics_carry(dashboard: dict[str, Any],
                                                        exposition: Exposition) -> None:
    for expr in _expressions(dashboard):
        carried = set(TARGET_LABELS) | {"le"}
        for name in metric_names(expr):
            carried |= exposition.labels.get(name, set())
        for name, matchers in selectors(expr):
            assert name in exposition.labels, f"{name}: no samples to check labels against"
            for label, value in matchers.items():
                assert label in exposition.labels[name] | TARGET_LABELS, (expr, label)
                if name == "tgi_request_failure" and label == "err":
                    assert value in ERR_VALUES, (expr, value)
        assert grouping_labels(expr) <= carried, expr


def test_the_rate_limit_panel_counts_what_a_key_limit_produces(
        dashboard: dict[str, Any], exposition: Exposition) -> None:
    # traffic_gateway spent a key's rpm: its 429 is counted under err="rate_limited".
    assert "rate_limited" in exposition.label_values[("tgi_request_failure", "err")]
    assert any('tgi_request_failure{err="rate_limited"' in e for e in _expressions(dashboard))


def test_template_variables_read_exported_labels(dashboard: dict[str, Any],
                                                 exposition: Exposition) -> None:
    for name, query in _variable_queries(dashboard).items():
        match = _LABEL_VALUES.fullmatch(query)
        assert match, query
        (metric,), label = metric_names(match.group(1)), match.group(2)
        assert metric in exposition.series
        assert label in exposition.labels[metric] | TARGET_LABELS, (name, label)
        assert label == name


def test_expressions_parse_as_promql(dashboard: dict[str, Any]) -> None:
    """A real PromQL parser (promql-parser, the Rust crate) agrees on syntax and names."""
    promql = pytest.importorskip("promql_parser")
    for expr in [*_expressions(dashboard)]:
        tree = promql.parse(interpolate(expr))
        found: set[str] = set()

        def visit(node: Any, found: set[str] = found) -> None:
            if isinstance(node, promql.VectorSelector) and node.name:
                found.add(node.name)

        promql.walk(tree, visit)
        assert found == metric_names(expr), expr


def test_the_name_lexer() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, model) (rate(a_bucket{model=~"$model",'
            'x="by(q)"}[$__rate_interval]))) / on (model) group_left b + 1e3 * c offset 5m')
    assert metric_names(expr) == {"a_bucket", "b", "c"}
    assert grouping_labels(expr) == {"le", "model"}
    assert selectors(expr) == [("a_bucket", {"model": "$model", "x": "by(q)"})]
