"""taskonce: effectively-once Celery tasks and Dramatiq actors.

Brokers deliver at least once; taskonce is the idempotent receiver in front of your handlers.
docs/how-it-works.md describes keys, modes, the decision table and the events.
"""

from __future__ import annotations

from taskonce.current import current_key
from taskonce.errors import (
    ConfigError,
    InProgressElsewhere,
    InvalidInput,
    LeaseLost,
    PayloadMismatch,
    Quarantined,
    SendRefused,
    StoreUnavailable,
    TaskonceError,
)
from taskonce.events import EventSink, JsonlEvents, LoggingEvents
from taskonce.guard import Decision, Delivery, Guard, Outcome, Ticket
from taskonce.handoff import Receipt, Send, send_now
from taskonce.outbox import send_on_commit
from taskonce.policy import Policy
from taskonce.session import current_session
from taskonce.stores import MemoryStore, Record, Status, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "Decision",
    "Delivery",
    "EventSink",
    "Guard",
    "InProgressElsewhere",
    "InvalidInput",
    "JsonlEvents",
    "LeaseLost",
    "LoggingEvents",
    "MemoryStore",
    "OpenTelemetryEvents",
    "Outcome",
    "PayloadMismatch",
    "Policy",
    "PrometheusEvents",
    "Quarantined",
    "Receipt",
    "Record",
    "Send",
    "SendRefused",
    "Status",
    "Store",
    "StoreUnavailable",
    "TaskonceError",
    "Ticket",
    "__version__",
    "current_key",
    "current_session",
    "open_store",
    "send_now",
    "send_on_commit",
]


def __getattr__(name: str) -> object:
    # These import optional packages (drivers, metrics clients); load them only when asked for.
    if name == "PrometheusEvents":
        from taskonce.prometheus_events import PrometheusEvents

        return PrometheusEvents
    if name == "OpenTelemetryEvents":
        from taskonce.otel_events import OpenTelemetryEvents

        return OpenTelemetryEvents
    if name == "RedisStore":
        from taskonce.stores.redis import RedisStore

        return RedisStore
    if name == "SQLStore":
        from taskonce.stores.sql import SQLStore

        return SQLStore
    raise AttributeError(f"module 'taskonce' has no attribute {name!r}")
