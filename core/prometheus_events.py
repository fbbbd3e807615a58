"""Prometheus metrics from the guard's events: ``taskonce.PrometheusEvents()``.

Needs the ``prometheus`` extra (``prometheus-client``). Works in one process and in Celery
prefork or Dramatiq multi-process workers through the client's multiprocess mode: set
``PROMETHEUS_MULTIPROC_DIR`` to an empty directory before the worker starts, and serve that
directory from one process with :func:`serve` (or ``python -m taskonce.prometheus_events``).
The metric names are public: the Grafana dashboard in ``docs/`` is built on them.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from taskonce.errors import ConfigError
from taskonce.events import Event, HeldClaims

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from taskonce.stores.base import Store

MULTIPROC_DIR = "PROMETHEUS_MULTIPROC_DIR"
#: The labels every per-delivery metric carries. Never the key or message id: one series per
#: message would grow without bound.
LABELS = ("queue", "task", "framework")
#: Handler durations run from milliseconds to the lease (300 s by default).
DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Recovery after a dead worker: at once on its own host, about 12 s from another one.
RECOVERY_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 12.5, 15, 20, 30, 60, 120, 300)

#: The store calls a delivery makes (and the liveness and relay ones), timed by
#: :meth:`PrometheusEvents.time_store`.
STORE_OPERATIONS = (
    "claim",
    "take_over",
    "complete",
    "complete_in",
    "release",
    "renew",
    "mark",
    "mark_in",
    "get",
    "beat",
    "seen",
    "take_sends",
    "dispatched",
    "pending_sends",
    "take_receipts",
    "settle_receipts",
    "have_records",
    "due_for_relay",
)
#: Store calls take from a fraction of a millisecond (one Redis script) to seconds (a timeout).
STORE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

_SENDS: dict[str, str] = {
    Event.SENDS_DEFERRED: "deferred",
    Event.SENDS_DISPATCHED: "dispatched",
    Event.SENDS_REDISPATCHED: "redispatched",
    Event.SENDS_DISCARDED: "discarded",
    Event.SEND_UNCONFIRMED: "unconfirmed",
}

_registered: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()
_registered_lock = threading.Lock()


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise ConfigError(
            "PrometheusEvents needs prometheus-client: pip install 'taskonce[prometheus]'"
        ) from exc
    return prometheus_client


class _Metrics:
    """The metric objects, once per registry (a registry refuses a name twice)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        client = _client()
        self.events = client.Counter(
            "taskonce_events",
            "Guard decisions and outcomes by event name (claimed, completed, duplicate_skipped…)",
            ("event", *LABELS),
            registry=registry,
        )
        self.sends = client.Counter(
            "taskonce_sends",
            "Messages handed off by guarded handlers, by what happened to them",
            ("event", *LABELS),
            registry=registry,
        )
        self.quarantined = client.Counter(
            "taskonce_quarantined",
            "Keys quarantined: their handler's process died more than crash_limit times",
            LABELS,
            registry=registry,
        )
        self.duration = client.Histogram(
            "taskonce_handler_duration_seconds",
            "Handler run time, from the guard's decision to its recorded outcome",
            ("outcome", *LABELS),
            buckets=DURATION_BUCKETS,
            registry=registry,
        )
        self.recovery = client.Histogram(
            "taskonce_takeover_recovery_seconds",
            "Seconds from a dead or silent owner's last sign of life to the takeover",
            ("queue", "reason"),
            buckets=RECOVERY_BUCKETS,
            registry=registry,
        )
        self.store = client.Histogram(
            "taskonce_store_call_duration_seconds",
            "Store calls as the guard waits for them: the round trip, plus any wait for a "
            "round trip shared with other threads",
            ("operation", "store"),
            buckets=STORE_BUCKETS,
            registry=registry,
        )
        self.claims = client.Gauge(
            "taskonce_claims_in_progress",
            "Eager claims held by running handlers",
            LABELS,
            multiprocess_mode="livesum",
            registry=registry,
        )


class PrometheusEvents:
    """An event sink that counts the guard's events as Prometheus metrics.

    ``taskonce_events_total{event,queue,task,framework}`` counts every event;
    ``taskonce_sends_total{event,…}`` counts handed-off messages (deferred, dispatched,
    redispatched, discarded, and ``unconfirmed``: given up on after the receipt's tries);
    ``taskonce_handler_duration_seconds{outcome,…}`` is a histogram
    of handler run time (outcome ``completed``, ``marked``, ``released``, …);
    ``taskonce_takeover_recovery_seconds{queue,reason}`` a histogram of recovery after a dead
    worker; ``taskonce_quarantined_total{queue,task,framework}`` counts keys quarantined after
    crash loops (``Policy.crash_limit``); ``taskonce_claims_in_progress{…}`` a gauge of the
    claims this process holds; and,
    for a store passed through :meth:`time_store`, ``taskonce_store_call_duration_seconds``.

    :param registry: where the metrics live; default ``prometheus_client.REGISTRY``. In
        multiprocess mode the values go to ``PROMETHEUS_MULTIPROC_DIR`` whatever the registry.
    :raises ConfigError: when ``prometheus-client`` is not installed.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        client = _client()
        target = client.REGISTRY if registry is None else registry
        with _registered_lock:
            metrics = _registered.get(target)
            if metrics is None:
                metrics = _registered[target] = _Metrics(target)
        self._metrics = metrics
        self._held: HeldClaims[tuple[str, str, str]] = HeldClaims()

    def time_store(self, store: Store) -> Store:
        """Time ``store``'s calls into ``taskonce_store_call_duration_seconds{operation,store}``
        and return it: ``Guard(sink.time_store(open_store(url)), events=[sink])``.

        The store's methods are wrapped on this one object (its class is unchanged); each call
        costs two clock reads and one observation. A store is timed once, however often this
        is called.
        """
        kind = type(store).__name__
        for operation in STORE_OPERATIONS:
            method = getattr(store, operation, None)
            if method is None or getattr(method, "_taskonce_timed", False):
                continue
            setattr(store, operation, _timed(method, self._metrics.store.labels(operation, kind)))
        return store

    def emit(self, event: Mapping[str, Any]) -> None:
        name = str(event["event"])
        labels = (
            str(event.get("queue") or ""),
            str(event.get("task") or ""),
            str(event.get("framework") or ""),
        )
        metrics = self._metrics
        metrics.events.labels(name, *labels).inc()
        count = event.get("count")
        if name in _SENDS and count:
            metrics.sends.labels(_SENDS[name], *labels).inc(count)
        elif name == Event.QUARANTINED:
            metrics.quarantined.labels(*labels).inc()
        duration_ms = event.get("duration_ms")
        if duration_ms is not None:
            metrics.duration.labels(name, *labels).observe(duration_ms / 1000.0)
        recovery_s = event.get("recovery_s")
        if name == Event.LEASE_TAKEN_OVER and recovery_s is not None:
            metrics.recovery.labels(labels[0], str(event.get("reason") or "")).observe(recovery_s)
        change = self._held.change(name, event.get("key"), labels)
        if change is not None:
            metrics.claims.labels(*change[1]).inc(change[0])


def _timed(method: Any, histogram: Any) -> Any:
    @functools.wraps(method)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            histogram.observe(time.perf_counter() - started)

    timed._taskonce_timed = True  # type: ignore[attr-defined]
    return timed


class PendingSendsCollector:
    """Reads, at each scrape, how many handled records still have sends waiting to be
    published (``taskonce_sends_pending``): the relay's backlog, from the store itself, so it
    also counts what a dead worker left behind. One store call per scrape.

    :param store: the store the workers use.
    :param older_than: count only records pending for at least this many seconds; the default
        10 s leaves out those their worker is publishing right now (the relay waits as long).
    :param limit: count at most this many records.
    """

    def __init__(self, store: Store, older_than: float = 10.0, limit: int = 1000) -> None:
        self.store = store
        self.older_than = older_than
        self.limit = limit

    def describe(self) -> list[Metric]:
        return []  # not known without asking the store; keeps registration free of I/O

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import GaugeMetricFamily

        gauge = GaugeMetricFamily(
            "taskonce_sends_pending",
            "Handled records whose sends are not yet published, pending for at least "
            f"{self.older_than:g} s (at most {self.limit})",
        )
        gauge.add_metric([], len(self.store.due_for_relay(self.older_than, self.limit).sends))
        yield gauge


def scrape_registry(store: Store | None = None) -> CollectorRegistry:
    """The registry to expose: every process's values from ``PROMETHEUS_MULTIPROC_DIR`` when
    it is set, else this process's default registry; plus :class:`PendingSendsCollector` when a
    ``store`` is given."""
    client = _client()
    from prometheus_client import multiprocess

    registry: CollectorRegistry
    if os.environ.get(MULTIPROC_DIR):
        registry = client.CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    else:
        registry = client.REGISTRY
    if store is not None:
        registry.register(PendingSendsCollector(store))
    return registry


def serve(port: int, addr: str = "0.0.0.0", store: Store | None = None) -> Any:  # noqa: S104
    """Serve ``/metrics`` over HTTP on a daemon thread (:func:`scrape_registry`'s registry).

    Returns the ``(server, thread)`` pair of ``prometheus_client.start_http_server``; call
    ``server.shutdown()`` to stop it.
    """
    return _client().start_http_server(port, addr, registry=scrape_registry(store))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m taskonce.prometheus_events --port 9808 [--store URL]``: serve the metrics of
    every worker process writing to ``PROMETHEUS_MULTIPROC_DIR`` until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m taskonce.prometheus_events")
    parser.add_argument("--port", type=int, default=9808, help="0: any free port (printed)")
    parser.add_argument("--addr", default="0.0.0.0")  # noqa: S104
    parser.add_argument("--store", help="store URL: also report taskonce_sends_pending")
    options = parser.parse_args(argv)
    if not os.environ.get(MULTIPROC_DIR):
        parser.error("set PROMETHEUS_MULTIPROC_DIR to the directory the workers write to")
    store = None
    if options.store:
        from taskonce.stores import open_store

        store = open_store(options.store)
    server, _ = serve(options.port, options.addr, store)
    host, port = server.server_address[:2]
    sys.stdout.write(f"serving http://{host}:{port}/metrics from {os.environ[MULTIPROC_DIR]}\n")
    sys.stdout.flush()
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
