"""Events: one flat record per guard decision, to logging (always) and optional sinks.

The field and event names are public (docs/how-it-works.md, Events): ``taskonce audit`` reads them.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

logger = logging.getLogger("taskonce.events")


class Event(str, enum.Enum):
    """The event names (docs/how-it-works.md, Events). A ``str`` enum: a member equals, hashes
    and JSON-encodes as its name, so records, JSON lines and the audit read the same text;
    events carry the plain value (``Event.CLAIMED.value``)."""

    CLAIMED = "claimed"
    COMPLETED = "completed"
    RELEASED = "released"
    MARKED = "marked"
    DUPLICATE_SKIPPED = "duplicate_skipped"
    IN_PROGRESS_DEFERRED = "in_progress_deferred"
    LEASE_TAKEN_OVER = "lease_taken_over"
    LEASE_RENEWED = "lease_renewed"
    LEASE_LOST = "lease_lost"
    CONCURRENT_DUPLICATE = "concurrent_duplicate"
    PAYLOAD_MISMATCH = "payload_mismatch"
    STORE_ERROR = "store_error"
    PURGED = "purged"
    QUARANTINED = "quarantined"
    SENDS_DEFERRED = "sends_deferred"
    SENDS_DISPATCHED = "sends_dispatched"
    SENDS_REDISPATCHED = "sends_redispatched"
    SENDS_DISCARDED = "sends_discarded"
    SEND_UNCONFIRMED = "send_unconfirmed"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return self.value.__format__(spec)


#: Every event name, as plain strings.
EVENT_NAMES = frozenset(event.value for event in Event)

FIELDS = (
    "ts",
    "event",
    "key",
    "queue",
    "message_id",
    "task",
    "framework",
    "mode",
    "worker",
    "attempt",
    "redelivered",
    "duration_ms",
    "lease_s",
    "keep_for_s",
    "reason",
    "recovery_s",
    "count",
)

# store_error is not among them: an outage is logged once per change (taskonce.outage), not
# once per delivery; the event still reaches every sink.
_WARNING_EVENTS = frozenset(
    {
        Event.LEASE_LOST,
        Event.CONCURRENT_DUPLICATE,
        Event.PAYLOAD_MISMATCH,
        Event.QUARANTINED,
        Event.SEND_UNCONFIRMED,
    }
)
_INFO_EVENTS = frozenset(
    {
        Event.DUPLICATE_SKIPPED,
        Event.IN_PROGRESS_DEFERRED,
        Event.LEASE_TAKEN_OVER,
        Event.PURGED,
        Event.SENDS_REDISPATCHED,
        Event.SENDS_DISCARDED,
    }
)
_HOST = socket.gethostname()


def worker_id() -> str:
    """``host:pid`` of this process (the pid changes after a fork, so it is read each time)."""
    return f"{_HOST}:{os.getpid()}"


_second_cache: tuple[int, str] = (-1, "")


def utc_now_iso() -> str:
    """ISO 8601 UTC with milliseconds, e.g. ``2026-11-22T03:10:36.123Z``."""
    global _second_cache
    now = time.time()
    second = int(now)
    if _second_cache[0] != second:  # formatting the date is the costly part; once a second
        _second_cache = (second, time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second)))
    return f"{_second_cache[1]}.{int((now - second) * 1000):03d}Z"


def make_event(event: Event | str, **fields: Any) -> dict[str, Any]:
    """An event with every public field present (``None`` where it does not apply); its
    ``event`` is the name's plain text."""
    if event not in EVENT_NAMES:
        raise ValueError(f"unknown event name {event!r}")
    name = Event(event).value
    unknown = set(fields) - set(FIELDS)
    if unknown:
        raise ValueError(f"unknown event field(s) {sorted(unknown)}")
    record: dict[str, Any] = dict.fromkeys(FIELDS)
    record.update(fields)
    record["ts"] = fields.get("ts") or utc_now_iso()
    record["event"] = name
    record["worker"] = fields.get("worker") or worker_id()
    return record


@runtime_checkable
class EventSink(Protocol):
    """Anything with ``emit(event)``; it must not raise for a well-formed event."""

    def emit(self, event: Mapping[str, Any]) -> None: ...


def log_level(name: Event | str) -> int:
    """The level at which :class:`LoggingEvents` logs event ``name``."""
    if name in _WARNING_EVENTS:
        return logging.WARNING
    if name in _INFO_EVENTS:
        return logging.INFO
    return logging.DEBUG


L = TypeVar("L")


class HeldClaims(Generic[L]):
    """The claims this process holds, by key, with the labels each was counted under: what a
    metrics sink's "claims in progress" gauge needs so that it goes up once per claim and down
    once, under the same labels, however the events repeat. A forked child holds none."""

    STARTS = frozenset({Event.CLAIMED, Event.LEASE_TAKEN_OVER})
    ENDS = frozenset(
        {Event.COMPLETED, Event.RELEASED, Event.LEASE_LOST, Event.STORE_ERROR, Event.MARKED}
    )

    def __init__(self) -> None:
        self._after_fork()
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        # The parent's lock may have been held at the fork.
        self._lock = threading.Lock()
        self._held: dict[Any, L] = {}

    def change(self, name: Event | str, key: Any, labels: L) -> tuple[int, L] | None:
        """How event ``name`` of ``key`` moves the gauge: ``(+1, labels)``, ``(-1, the labels
        the claim was counted under)``, or None."""
        if key is None:
            return None
        if name in self.STARTS:
            with self._lock:
                if key in self._held:
                    return None
                self._held[key] = labels
            return 1, labels
        if name in self.ENDS:
            with self._lock:
                held = self._held.pop(key, None)
            return None if held is None else (-1, held)
        return None


class LoggingEvents:
    """Logs every event on the ``taskonce.events`` logger: warnings for lease_lost,
    concurrent_duplicate and payload_mismatch; info for skips, deferrals, take-overs and purges;
    debug for the routine claim/complete/mark/release/renew and for store_error (an outage is
    logged once per change by the guard, :class:`~taskonce.outage.StoreHealth`)."""

    @staticmethod
    def wants(name: Event | str) -> bool:
        """Whether event ``name`` would be logged at the logger's current level."""
        return logger.isEnabledFor(log_level(name))

    def emit(self, event: Mapping[str, Any]) -> None:
        level = log_level(event["event"])
        if logger.isEnabledFor(level):
            logger.log(
                level,
                "%s key=%s task=%s mode=%s attempt=%s",
                event["event"],
                event.get("key"),
                event.get("task"),
                event.get("mode"),
                event.get("attempt"),
                extra={"taskonce_event": dict(event)},
            )


class Sinks(list[EventSink]):
    """A guard's event sinks (:class:`LoggingEvents` first): a list, so sinks can be added
    later, that sends each event to every sink."""

    def quiet(self, name: Event | str) -> bool:
        """Whether nobody would see event ``name`` (logging alone, below its level): the
        caller may skip building it."""
        return len(self) == 1 and not LoggingEvents.wants(name)

    def send(self, event: dict[str, Any]) -> None:
        """Give ``event`` to every sink; a sink that raises is logged, never passed on (an
        event sink must never change a delivery's outcome)."""
        for sink in self:
            try:
                sink.emit(event)
            except Exception:
                logging.getLogger("taskonce").exception("event sink %r failed", sink)


class JsonlEvents:
    """Appends each event as one JSON line to ``path``.

    The file is opened with ``O_APPEND`` and each line written with one ``write`` call, so
    lines from threads and from processes on one host never interleave. Safe across fork: the
    child reopens the file on first use.

    :param path: the file; its directory is created if missing.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid = -1
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()

    def emit(self, event: Mapping[str, Any]) -> None:
        line = (json.dumps(event, separators=(",", ":"), default=str) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._pid = os.getpid()
            os.write(self._fd, line)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                os.close(self._fd)
            self._fd = None


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All events of a JSONL file (for tests and small tools)."""
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
