"""Prometheus's relabelling (`relabel_configs`), the `keep` and `replace` actions: what a
scrape job makes of a discovered target's labels, to check a shipped job against the pods it
is meant for."""

from __future__ import annotations

import re
from typing import Any

# kubernetes_sd turns an annotation's name into a label name: anything but [a-zA-Z0-9_] -> _
_UNSAFE = re.compile(r"[^a-zA-Z0-9_]")


def annotation_label(name: str) -> str:
    return "__meta_kubernetes_pod_annotation_" + _UNSAFE.sub("_", name)


def _expand(replacement: str) -> str:
    """Prometheus's `$1` / `${1}` as Python's `\\g<1>`."""
    return re.sub(r"\$\{?(\w+)\}?", r"\\g<\1>", replacement)


def relabel(labels: dict[str, str], configs: list[dict[str, Any]]) -> dict[str, str] | None:
    """The target's labels after `configs`; None when a `keep` drops it."""
    out = dict(labels)
    for config in configs:
        value = config.get("separator", ";").join(
            out.get(name, "") for name in config.get("source_labels", []))
        match = re.fullmatch(config.get("regex", "(.*)"), value)
        action = config.get("action", "replace")
        if action == "keep":
            if match is None:
                return None
        elif action == "replace":
            if match is not None:
                out[config["target_label"]] = match.expand(
                    _expand(config.get("replacement", "$1")))
        else:
            raise ValueError(f"relabel action {action!r} is not modelled here")
    return out
