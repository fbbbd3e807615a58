"""OpenTelemetry from the guard's events: ``taskonce.OpenTelemetryEvents()``.

Needs the ``otel`` extra (``opentelemetry-api`` only): the application configures the SDK and
exporters as it already does. Each event is written onto the *current* span — the one Celery's
or Dramatiq's instrumentation opened for the message — and counted as OTel metrics.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from taskonce.errors import ConfigError
from taskonce.events import Event, HeldClaims

#: Span attributes set from each event (the latest event wins), named ``taskonce.<field>``.
SPAN_FIELDS = ("key", "queue", "message_id", "task", "framework", "mode", "attempt")
#: Fields added to a span event where the event carries them.
EVENT_FIELDS = ("duration_ms", "reason", "recovery_s", "count", "redelivered")
#: What the guard decided, for the events that carry a decision.
DECISIONS: dict[str, str] = {
    Event.CLAIMED: "run",
    Event.LEASE_TAKEN_OVER: "run",
    Event.MARKED: "run",
    Event.CONCURRENT_DUPLICATE: "run",
    Event.DUPLICATE_SKIPPED: "skip",
    Event.SENDS_REDISPATCHED: "skip",
    Event.IN_PROGRESS_DEFERRED: "defer",
    Event.PAYLOAD_MISMATCH: "refuse",
    Event.QUARANTINED: "refuse",
}


def _api() -> tuple[Any, Any]:
    try:
        from opentelemetry import metrics, trace
    except ImportError as exc:
        raise ConfigError(
            "OpenTelemetryEvents needs opentelemetry-api: pip install 'taskonce[otel]'"
        ) from exc
    return trace, metrics


class OpenTelemetryEvents:
    """An event sink that puts the guard's decision on the current span and counts events as
    OpenTelemetry metrics.

    On the current span (if it is recording): the attributes ``taskonce.event`` (the latest
    event), ``taskonce.decision`` (``run``, ``skip``, ``defer`` or ``refuse``) and
    ``taskonce.key``, ``.queue``, ``.message_id``, ``.task``, ``.framework``, ``.mode``,
    ``.attempt``; and one span event ``taskonce.<event name>`` per event. Metrics (meter
    ``taskonce``): the counters ``taskonce.events`` (attributes ``event``, ``queue``, ``task``,
    ``framework``) and ``taskonce.sends`` (messages handed off), the histogram
    ``taskonce.handler.duration`` (seconds, attribute ``outcome``) and the up-down counter
    ``taskonce.claims.in_progress``.

    :param meter_provider: where the metrics go; default the global meter provider.
    :raises ConfigError: when ``opentelemetry-api`` is not installed.
    """

    def __init__(self, meter_provider: Any = None) -> None:
        trace, metrics = _api()
        self._trace = trace
        provider = meter_provider if meter_provider is not None else metrics.get_meter_provider()
        meter = provider.get_meter("taskonce")
        self._events = meter.create_counter(
            "taskonce.events", unit="{event}", description="Guard decisions and outcomes"
        )
        self._sends = meter.create_counter(
            "taskonce.sends", unit="{message}", description="Messages handed off by handlers"
        )
        self._duration = meter.create_histogram(
            "taskonce.handler.duration", unit="s", description="Handler run time"
        )
        self._claims = meter.create_up_down_counter(
            "taskonce.claims.in_progress", unit="{claim}", description="Eager claims held"
        )
        self._held: HeldClaims[dict[str, str]] = HeldClaims()

    def emit(self, event: Mapping[str, Any]) -> None:
        name = str(event["event"])
        labels = {
            "queue": str(event.get("queue") or ""),
            "task": str(event.get("task") or ""),
            "framework": str(event.get("framework") or ""),
        }
        self._events.add(1, {"event": name, **labels})
        count = event.get("count")
        if name.startswith("sends_") and count:
            self._sends.add(count, {"event": name.removeprefix("sends_"), **labels})
        duration_ms = event.get("duration_ms")
        if duration_ms is not None:
            self._duration.record(duration_ms / 1000.0, {"outcome": name, **labels})
        change = self._held.change(name, event.get("key"), labels)
        if change is not None:
            self._claims.add(*change)
        span = self._trace.get_current_span()
        if not span.is_recording():
            return
        attributes: dict[str, Any] = {"taskonce.event": name}
        if name in DECISIONS:
            attributes["taskonce.decision"] = DECISIONS[name]
        for field in SPAN_FIELDS:
            value = event.get(field)
            if value is not None:
                attributes[f"taskonce.{field}"] = value
        span.set_attributes(attributes)
        details = {f: event[f] for f in EVENT_FIELDS if event.get(f) is not None}
        span.add_event(f"taskonce.{name}", details)
