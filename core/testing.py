"""Testing helpers for taskonce users: a guard per test, "deliver it twice and see it skipped",
the sends a block made, and the relay run now. docs/testing.md shows each with an example.

Delivering twice lives in :mod:`taskonce.testing_runs` and is re-exported here. Nothing here
imports Celery, Dramatiq, SQLAlchemy or Django until a helper needs it, so the pytest plugin
(:mod:`taskonce.pytest_plugin`, which wraps these helpers in fixtures) costs nothing in a test
session that does not use it. Every helper works without pytest too.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from taskonce import handoff
from taskonce.errors import ConfigError
from taskonce.events import Event, EventSink
from taskonce.guard import Guard
from taskonce.policy import Policy
from taskonce.stores import MemoryStore, Store, open_store
from taskonce.testing_runs import (
    OUTCOMES,
    DeliveryReport,
    EventLog,
    Twice,
    assert_runs_once,
    deliver_twice,
    events_of,
    join_all,
)

if TYPE_CHECKING:
    from dramatiq.brokers.stub import StubBroker

# -- a guard for a test --------------------------------------------------------------------


def make_guard(
    store: str | Store = "memory",
    *,
    path: str | os.PathLike[str] | None = None,
    default: Policy | Mapping[str, Any] | None = None,
    queues: Mapping[str, Policy | Mapping[str, Any]] | None = None,
    events: Iterable[EventSink] = (),
    **options: Any,
) -> Guard:
    """A guard for one test, with an :class:`EventLog` among its sinks (:func:`events_of`).
    Close it after the test (``guard.close()``, or ``with make_guard() as guard:``).

    :param store: ``"memory"`` (default), ``"sqlite"`` (a file in ``path``, tables created),
        any store URL, or a :class:`~taskonce.Store`.
    :param path: for ``"sqlite"``: a directory (the file is ``taskonce.db`` in it, e.g. pytest's
        ``tmp_path``) or the database file itself.
    :param default: the default policy (a :class:`~taskonce.Policy` or a dict of its fields).
    :param queues: per-queue policies, as for :class:`~taskonce.Guard`.
    :param events: more event sinks.
    :param options: other :class:`~taskonce.Guard` arguments (``send_limit``,
        ``dispatch_lease``).
    """
    opened = _open(store, path)
    try:
        return Guard(
            opened, default=default, queues=queues, events=[EventLog(), *events], **options
        )
    except BaseException:
        if opened is not store:
            opened.close()
        raise


def _open(store: str | Store, path: str | os.PathLike[str] | None) -> Store:
    if isinstance(store, Store):
        return store
    if store == "memory":
        return MemoryStore()
    if store == "sqlite":
        if path is None:
            raise ConfigError(
                'make_guard("sqlite") needs path=: a directory (pytest\'s tmp_path) or a file'
            )
        target = Path(path)
        file = target / "taskonce.db" if target.is_dir() else target
        opened = open_store(f"sqlite:///{file}")
        # Created now: SQLite cannot create it later inside a caller's write transaction.
        opened.create_tables()  # type: ignore[attr-defined]
        return opened
    if isinstance(store, str) and "://" in store:
        return open_store(store)
    raise ConfigError(
        f"make_guard(store={store!r}): use 'memory', 'sqlite', a store URL or a taskonce Store"
    )


def celery_app(guard: Guard, name: str | None = None, **conf: Any) -> Any:
    """A Celery app for tests (in-memory broker, not the current app) whose tasks ``guard``
    guards: ``setup(app, guard)`` done. ``conf`` goes to ``app.conf``."""
    from celery import Celery

    from taskonce.celery_ext import setup

    app = Celery(name or f"taskonce-test-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(broker_url="memory://", **conf)
    setup(app, guard)
    return app


def stub_broker(guard: Guard, *, set_global: bool = True, relay_every: float = 0.0) -> StubBroker:
    """Dramatiq's ``StubBroker`` with ``IdempotencyMiddleware(guard)``; the global broker
    (``dramatiq.set_broker``) unless ``set_global=False``, so actors declared next use it.
    ``relay_every`` (default 0: off) is the middleware's; :func:`publish_pending` relays now."""
    import dramatiq
    from dramatiq.brokers.stub import StubBroker

    from taskonce.dramatiq_ext import IdempotencyMiddleware

    broker = StubBroker()
    broker.add_middleware(IdempotencyMiddleware(guard, relay_every=relay_every))
    if set_global:
        dramatiq.set_broker(broker)
    return broker


def drain_broker(
    broker: StubBroker,
    *,
    timeout: float = 10.0,
    fail_fast: bool = True,
    worker_threads: int = 1,
) -> None:
    """Run a Dramatiq worker on ``broker`` (a ``StubBroker``) until every queue is empty,
    delayed messages included, then stop it. ``fail_fast``: raise the exception of a message
    that was dead-lettered (``StubBroker.join``'s). A :class:`TimeoutError` after ``timeout``
    seconds says which queues still hold messages (an actor retrying with Dramatiq's default
    backoff of 15 s and more is the usual reason: declare test actors with ``max_retries=0``)."""
    import dramatiq

    deadline = time.monotonic() + timeout
    worker = dramatiq.Worker(broker, worker_threads=worker_threads, worker_timeout=50)
    worker.start()
    try:
        join_all(broker, deadline, fail_fast)
        worker.join()
    finally:
        worker.stop()


# -- the sends a block made ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CapturedSend:
    """One message a block sent, captured instead of published (:func:`captured_sends`).

    :param framework: ``"celery"`` or ``"dramatiq"`` (``"python"`` for your own senders).
    :param name: the task or actor name.
    :param args: its positional arguments.
    :param kwargs: its keyword arguments.
    :param message_id: the id it would be published under.
    :param queue: the queue it goes to (Celery: as routed; Dramatiq: the actor's queue).
    :param options: Celery: the message's headers (``eta``, ``expires``, ``retries``,
        ``root_id``, …; a ``countdown`` is already an ``eta``); Dramatiq: the message options,
        plus ``delay`` when one was given.
    :param body: the captured body, as the store would keep it.
    """

    framework: str
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    message_id: str
    queue: str | None
    options: dict[str, Any]
    body: dict[str, Any]

    def __str__(self) -> str:
        params = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"{self.framework} {self.name}({', '.join(params)}) [id {self.message_id}]"

    @classmethod
    def of(cls, send: handoff.Send) -> CapturedSend:
        """The readable form of a captured :class:`~taskonce.Send`."""
        body = send.body
        args: Any = body.get("args") or []
        kwargs: Any = body.get("kwargs") or {}
        options = dict(body.get("options") or {})
        if send.framework == "celery" and "message" in body:
            from taskonce.celery_ext.message import decoded

            args, kwargs, options = decoded(body["message"])
            name, queue = body.get("task"), options.get("taskonce_queue")
        elif send.framework == "celery":  # as taskonce 0.x stored it
            from kombu.utils import json as kombu_json

            # kombu's type tags back into datetimes, UUIDs, Decimals, as the publisher does
            args, kwargs = kombu_json.loads(json.dumps([args, kwargs]))  # type: ignore[no-untyped-call]
            name, queue = body.get("task"), options.get("queue")
        else:
            if send.framework == "dramatiq" and "message" in body:
                from dramatiq import Message

                message = Message.decode(base64.b64decode(body["message"]))
                args, kwargs, options = message.args, message.kwargs, dict(message.options)
            name = body.get("actor_name") or body.get("task")
            queue = body.get("queue_name")
            if body.get("delay") is not None:
                options["delay"] = body["delay"]
        return cls(
            framework=send.framework,
            name=str(name),
            args=tuple(args),
            kwargs=dict(kwargs),
            message_id=send.id,
            queue=None if queue is None else str(queue),
            options=options,
            body=body,
        )


class _Collecting(handoff.Capture):
    """A capture that also lists each send in readable form as it is made."""

    __slots__ = ("found",)
    for_test = True

    def __init__(self, found: list[CapturedSend]) -> None:
        super().__init__(f"taskonce-testing:{uuid.uuid4().hex}", "captured_sends()")
        self.found = found

    def add(
        self,
        framework: str,
        body: dict[str, Any],
        message_id: str | None = None,
        *,
        name: str | None = None,
        size: int | None = None,
    ) -> str:
        send_id = super().add(framework, body, message_id, name=name, size=size)
        self.found.append(CapturedSend.of(self.sends[-1]))
        return send_id


@contextlib.contextmanager
def captured_sends() -> Iterator[list[CapturedSend]]:
    """``with captured_sends() as sent: ...`` — what the block sends (Celery ``delay``,
    ``apply_async``, ``send_task``, signatures; Dramatiq ``send``, ``send_with_options``,
    ``broker.enqueue``) is captured and listed in ``sent`` (:class:`CapturedSend`), never
    published. The hand-off's own capture does it, so the app or broker must have a guard
    (``setup(app, guard)``; ``IdempotencyMiddleware(guard)``): without one, sends leave as
    usual. Sends made in a ``send_on_commit()`` block inside it (Django's or SQLAlchemy's) are
    captured the same way: no outbox row is written and nothing is published at the commit.
    Celery's ``task_always_eager`` runs ``delay`` in place instead of sending. Arguments that
    JSON cannot store raise :class:`~taskonce.SendRefused`, as in a guarded handler."""
    found: list[CapturedSend] = []
    with handoff.capturing(_Collecting(found)):
        yield found


# -- the relay, now ------------------------------------------------------------------------


class _Counter:
    def __init__(self) -> None:
        self.count = 0

    def emit(self, event: Mapping[str, Any]) -> None:
        if event.get("event") == Event.SENDS_DISPATCHED:
            self.count += int(event.get("count") or 0)


def publish_pending(guard: Guard, *, batch: int = 100, strict: bool = True) -> int:
    """Publish every send pending in ``guard``'s store now, whatever its age (a hand-off's
    sends whose publish failed, ``send_on_commit`` rows whose publish did not happen): the
    relay's sweep with ``older_than=0``, repeated until a sweep finds nothing. Returns the
    number of messages published.

    :param strict: raise :class:`AssertionError` when sends are still pending afterwards (a
        publisher failed, see the log; or another dispatcher holds them, e.g. the recorder
        of a run that stopped between its record and its publish, for up to 10 s).
    """
    counter = _Counter()
    guard.sinks.append(counter)
    try:
        while guard.relay(older_than=0.0, batch=batch):
            pass
    finally:
        guard.sinks.remove(counter)
    if strict:
        left = guard.store.due_for_relay(0.0, batch).sends
        if left:
            raise AssertionError(
                f"{len(left)} record(s) still have sends pending after publish_pending(): "
                f"{', '.join(left[:5])}; a publisher failed (see the 'taskonce' log) or another "
                "dispatcher holds them"
            )
    return counter.count


__all__ = [
    "OUTCOMES",
    "CapturedSend",
    "DeliveryReport",
    "EventLog",
    "Twice",
    "assert_runs_once",
    "captured_sends",
    "celery_app",
    "deliver_twice",
    "drain_broker",
    "events_of",
    "make_guard",
    "publish_pending",
    "stub_broker",
]
