"""The Grafana dashboard and the documented alert rules use only metrics the sinks expose."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

import taskonce
from taskonce.prometheus_events import PendingSendsCollector, PrometheusEvents

ROOT = Path(__file__).resolve().parents[2]
METRIC = re.compile(r"\btaskonce_[a-z_]+\b")


def exposed() -> set[str]:
    """Every sample name the exposition has once each kind of event was seen."""
    registry = CollectorRegistry()
    sink = PrometheusEvents(registry)
    sink.time_store(taskonce.open_store("memory://")).get("q:m")
    base = {"key": "q:m", "queue": "q", "task": "t", "framework": "python"}
    sink.emit({**base, "event": "lease_taken_over", "reason": "owner_dead", "recovery_s": 0.5})
    sink.emit({**base, "event": "completed", "duration_ms": 3.0})
    sink.emit({**base, "event": "sends_deferred", "count": 2})
    sink.emit({**base, "event": "quarantined", "reason": "owner_dead", "count": 4})
    registry.register(PendingSendsCollector(taskonce.open_store("memory://")))
    return {s.name for metric in registry.collect() for s in metric.samples}


def test_the_dashboard_is_built_on_exposed_metrics() -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    expressions = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    variables = [v.get("definition", "") for v in dashboard["templating"]["list"]]
    used = {name for text in expressions + variables for name in METRIC.findall(text)}
    names = exposed()
    assert used - names == set()
    # every metric family shows somewhere on the dashboard
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in names}
    assert families <= {re.sub(r"_(total|bucket|count|sum)$", "", n) for n in used}
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])


def test_the_documented_metrics_and_alerts_are_exposed() -> None:
    page = (ROOT / "docs" / "operations.md").read_text()
    names = exposed()
    mentioned = set(METRIC.findall(page)) - {"taskonce_events"}
    families = {re.sub(r"_(total|bucket|count|sum|created)$", "", n) for n in names}
    unknown = {n for n in mentioned if n not in names and n not in families}
    assert unknown == set()
