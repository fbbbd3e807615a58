"""The metric sinks in one process: PrometheusEvents against its own registry, and
OpenTelemetryEvents against the OpenTelemetry SDK's in-memory span exporter and metric reader.
"""

from __future__ import annotations

import builtins
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry, generate_latest

import taskonce
from taskonce.otel_events import OpenTelemetryEvents
from taskonce.prometheus_events import PendingSendsCollector, PrometheusEvents
from tests.metrics.common import RaisingSink


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    return sum(
        s.value
        for metric in registry.collect()
        for s in metric.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def guard_with(*sinks: Any, **policy: Any) -> taskonce.Guard:
    return taskonce.Guard(taskonce.open_store("memory://"), default=policy or None, events=sinks)


LABELS = {"queue": "billing", "task": "tests.metrics.test_sinks.charge", "framework": "python"}


def charge(order: str) -> str:
    return f"charged {order}"


def test_prometheus_counts_events_durations_and_claims() -> None:
    registry = CollectorRegistry()
    guard = guard_with(PrometheusEvents(registry))
    inside: list[float] = []

    def watched(order: str) -> str:
        inside.append(sample(registry, "taskonce_claims_in_progress", **LABELS))
        return charge(order)

    watched.__qualname__ = watched.__name__ = "charge"
    for i in range(3):
        guard.run(f"m{i}", "billing", watched, "A")
    guard.run("m0", "billing", watched, "A")  # a duplicate
    with pytest.raises(RuntimeError):
        guard.run("m9", "billing", lambda: (_ for _ in ()).throw(RuntimeError("declined")))

    assert sample(registry, "taskonce_events_total", event="claimed", **LABELS) == 3
    assert sample(registry, "taskonce_events_total", event="completed", **LABELS) == 3
    assert sample(registry, "taskonce_events_total", event="duplicate_skipped", **LABELS) == 1
    assert (
        sample(registry, "taskonce_handler_duration_seconds_count", outcome="completed", **LABELS)
        == 3
    )
    assert inside == [1.0, 1.0, 1.0]  # held while the handler ran
    assert sample(registry, "taskonce_claims_in_progress", **LABELS) == 0
    assert (
        sample(
            registry, "taskonce_handler_duration_seconds_count", queue="billing", outcome="released"
        )
        == 1
    )
    assert b"taskonce_claims_in_progress" in generate_latest(registry)


def test_prometheus_counts_handed_off_messages_and_pending_sends() -> None:
    registry = CollectorRegistry()
    guard = guard_with(PrometheusEvents(registry))
    broker_up = False
    published: list[str] = []

    def publish(send: taskonce.Send) -> None:
        if not broker_up:
            raise ConnectionError("broker down")
        published.append(send.id)

    guard.register_publisher("python", publish)

    def checkout() -> None:
        for step in ("ship", "mail"):
            taskonce.handoff.current().add("python", {"task": step})  # type: ignore[union-attr]

    guard.run("m1", "shop", checkout)
    assert sample(registry, "taskonce_sends_total", event="deferred", queue="shop") == 2
    assert sample(registry, "taskonce_sends_total", event="dispatched") == 0
    pending = CollectorRegistry()
    pending.register(PendingSendsCollector(guard.store, older_than=0))
    assert pending.get_sample_value("taskonce_sends_pending") == 1  # the broker was down
    broker_up = True
    assert guard.relay(older_than=0) == 1
    assert pending.get_sample_value("taskonce_sends_pending") == 0
    assert len(published) == 2
    # the relay's event names the key only: its labels are empty
    assert sample(registry, "taskonce_sends_total", event="dispatched", queue="") == 2


def test_one_registry_takes_several_sinks() -> None:
    registry = CollectorRegistry()
    first, second = PrometheusEvents(registry), PrometheusEvents(registry)
    guard_with(first).run("m1", "q", len, "ab")
    guard_with(second).run("m2", "q", len, "ab")
    assert sample(registry, "taskonce_events_total", event="completed",
                  queue="q", task="builtins.len", framework="python") == 2  # fmt: skip


def test_time_store_times_each_call_once_and_keeps_the_store() -> None:
    registry = CollectorRegistry()
    sink = PrometheusEvents(registry)
    store = taskonce.open_store("memory://")
    assert sink.time_store(sink.time_store(store)) is store  # timed once, however often asked
    guard = taskonce.Guard(store, events=[sink])
    guard.run("m1", "q", charge, "A")
    guard.run("m1", "q", charge, "A")
    guard.run("m2", "q", charge, "A")
    count = "taskonce_store_call_duration_seconds_count"
    assert sample(registry, count, operation="claim", store="MemoryStore") == 3
    assert sample(registry, count, operation="complete", store="MemoryStore") == 2
    assert isinstance(store, taskonce.Store) and store.get("q:m1") is not None


def test_a_raising_sink_changes_no_outcome(caplog: pytest.LogCaptureFixture) -> None:
    registry = CollectorRegistry()
    runs: list[str] = []

    def record(order: str) -> str:
        runs.append(order)
        return order

    guard = guard_with(RaisingSink(), PrometheusEvents(registry), store_result=True)
    assert guard.run("m1", "q", record, "A").status == "ran"
    again = guard.run("m1", "q", record, "A")
    assert (again.status, again.value) == ("skipped", "A")
    with pytest.raises(taskonce.PayloadMismatch):
        guard.run("m1", "q", record, "B")
    assert runs == ["A"]
    assert "event sink" in caplog.text and "this sink is broken" in caplog.text
    # the sinks after the broken one still saw every event
    assert sample(registry, "taskonce_events_total", event="payload_mismatch", queue="q") == 1


def test_a_missing_extra_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def without(name: str, *args: Any, **kwargs: Any) -> Any:
        if name.startswith(("prometheus_client", "opentelemetry")):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    with pytest.raises(taskonce.ConfigError, match=r"pip install 'taskonce\[prometheus\]'"):
        taskonce.PrometheusEvents()
    with pytest.raises(taskonce.ConfigError, match=r"pip install 'taskonce\[otel\]'"):
        taskonce.OpenTelemetryEvents()


def test_the_exposition_command_needs_the_metrics_directory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from taskonce.prometheus_events import main

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["--port", "0"])
    assert exited.value.code == 2
    assert "set PROMETHEUS_MULTIPROC_DIR" in capsys.readouterr().err


@pytest.fixture
def otel() -> Any:
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    sink = OpenTelemetryEvents(meter_provider=meter_provider)
    yield sink, tracer_provider.get_tracer("test"), exporter, reader
    tracer_provider.shutdown()
    meter_provider.shutdown()


def test_otel_spans_carry_the_decision(otel: Any) -> None:
    sink, tracer, exporter, _ = otel
    guard = guard_with(sink)
    for name in ("first", "duplicate"):
        with tracer.start_as_current_span(name):  # the span a framework's instrumentation opens
            guard.run("m1", "billing", charge, "A")
    with tracer.start_as_current_span("mismatch"), pytest.raises(taskonce.PayloadMismatch):
        guard.run("m1", "billing", charge, "B")

    spans = {span.name: span for span in exporter.get_finished_spans()}
    first, duplicate, mismatch = spans["first"], spans["duplicate"], spans["mismatch"]
    assert first.attributes["taskonce.decision"] == "run"
    assert first.attributes["taskonce.event"] == "completed"
    assert first.attributes["taskonce.key"] == "billing:m1"
    assert first.attributes["taskonce.mode"] == "eager"
    assert [e.name for e in first.events] == ["taskonce.claimed", "taskonce.completed"]
    assert first.events[1].attributes["duration_ms"] >= 0
    assert duplicate.attributes["taskonce.decision"] == "skip"
    assert [e.name for e in duplicate.events] == ["taskonce.duplicate_skipped"]
    assert mismatch.attributes["taskonce.decision"] == "refuse"
    assert [e.name for e in mismatch.events] == ["taskonce.payload_mismatch"]


def test_otel_metrics_count_events(otel: Any) -> None:
    sink, _, _, reader = otel
    guard = guard_with(sink, mode="lazy")
    guard.run("m1", "q", charge, "A")
    guard.run("m1", "q", charge, "A")
    points: dict[str, list[Any]] = {}
    for resource in reader.get_metrics_data().resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points[metric.name] = list(metric.data.data_points)
    events = {p.attributes["event"]: p.value for p in points["taskonce.events"]}
    assert events == {"marked": 1, "duplicate_skipped": 1}
    assert [p.count for p in points["taskonce.handler.duration"]] == [1]
    assert points["taskonce.handler.duration"][0].attributes["outcome"] == "marked"


def test_otel_without_a_span_only_counts(otel: Any) -> None:
    sink, _, exporter, _ = otel
    guard_with(sink).run("m1", "q", charge, "A")  # no current span: nothing to annotate
    assert exporter.get_finished_spans() == ()


def test_a_claim_ends_once_whatever_ends_it() -> None:
    """lease_lost from the heartbeat and then from the final write: the gauge drops once."""
    registry = CollectorRegistry()
    sink = PrometheusEvents(registry)
    base = {"key": "q:m1", "queue": "q", "task": "t", "framework": "x"}
    for name in ("claimed", "lease_renewed", "lease_lost", "lease_lost", "released"):
        sink.emit({**base, "event": name})
    assert sample(registry, "taskonce_claims_in_progress", queue="q") == 0
    assert sample(registry, "taskonce_events_total", event="lease_lost", queue="q") == 2
