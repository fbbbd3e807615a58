"""Testing helpers for taskonce users: a guard per test, "deliver it twice and see it skipped",
the sends a block made, and the relay run now. docs/testing.md shows each with an example.

Nothing here imports Celery, Dramatiq, SQLAlchemy or Django until a helper needs it, so the
pytest plugin (:mod:`taskonce.pytest_plugin`, which wraps these helpers in fixtures) costs
nothing in a test session that does not use it. Every helper works without pytest too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from taskonce import handoff
from taskonce.errors import ConfigError, InProgressElsewhere, PayloadMismatch
from taskonce.events import Event, EventSink
from taskonce.guard import Guard
from taskonce.policy import Policy
from taskonce.stores import MemoryStore, Store, open_store

if TYPE_CHECKING:
    from dramatiq.brokers.stub import StubBroker

# -- events --------------------------------------------------------------------------------


class EventLog:
    """An in-memory event sink: every event the guard emits, in order (thread-safe appends).

    ``Guard(store, events=[log])``, or :func:`make_guard`, which adds one
    (:func:`events_of` finds it).
    """

    def __init__(self) -> None:
        #: the events, oldest first (flat dicts, see docs/how-it-works.md, Events)
        self.events: list[dict[str, Any]] = []

    def emit(self, event: Mapping[str, Any]) -> None:
        """Keep a copy of ``event``."""
        self.events.append(dict(event))

    def names(self, message_id: str | None = None) -> list[str]:
        """The event names, oldest first; only those of ``message_id`` when given."""
        return [e["event"] for e in self.events if message_id is None or _about(e, message_id)]

    def of(self, message_id: str) -> list[dict[str, Any]]:
        """The events of deliveries of ``message_id``."""
        return [e for e in self.events if _about(e, message_id)]

    def clear(self) -> None:
        """Forget the events seen so far."""
        self.events.clear()

    def __len__(self) -> int:
        return len(self.events)


def _about(event: Mapping[str, Any], message_id: str) -> bool:
    key = event.get("key")
    return event.get("message_id") == message_id or (
        isinstance(key, str) and (key == message_id or key.endswith(f":{message_id}"))
    )


def events_of(guard: Guard) -> EventLog:
    """The :class:`EventLog` among ``guard``'s sinks; one is added if it has none."""
    for sink in guard.sinks:
        if isinstance(sink, EventLog):
            return sink
    log = EventLog()
    guard.sinks.append(log)
    return log


@contextlib.contextmanager
def _recording(guard: Guard) -> Iterator[EventLog]:
    """A fresh :class:`EventLog` on ``guard`` for the block only."""
    log = EventLog()
    guard.sinks.append(log)
    try:
        yield log
    finally:
        guard.sinks.remove(log)


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
        _join_all(broker, deadline, fail_fast)
        worker.join()
    finally:
        worker.stop()


def _join_all(broker: StubBroker, deadline: float, fail_fast: bool) -> None:
    from dramatiq.common import q_name
    from dramatiq.errors import QueueJoinTimeout

    while True:
        names = sorted({q_name(name) for name in broker.queues})
        for name in names:
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                broker.join(name, timeout=left, fail_fast=fail_fast)
            except QueueJoinTimeout:
                busy = {
                    n: q.unfinished_tasks for n, q in broker.queues.items() if q.unfinished_tasks
                }
                raise TimeoutError(
                    f"the Dramatiq queues still hold messages after the deadline: {busy} (an "
                    "actor retrying with Dramatiq's backoff? declare test actors with "
                    "max_retries=0)"
                ) from None
        # An actor of one queue may have sent to a queue joined before it: look again.
        if not any(queue.unfinished_tasks for queue in broker.queues.values()):
            return


# -- deliver twice -------------------------------------------------------------------------

#: Each outcome of :class:`DeliveryReport`, with what it means (assertion messages use it).
OUTCOMES = {
    "ran": "ran, and the guard recorded it",
    "skipped": "skipped as a duplicate",
    "deferred": "deferred: the key was claimed by another delivery still in progress",
    "failed": "failed",
    "refused": "refused: same message id, different arguments (payload_mismatch)",
    "store_error": "met an unreachable store",
    "unguarded": "ran unguarded: the guard emitted no event for it",
}


@dataclasses.dataclass(frozen=True)
class DeliveryReport:
    """One delivery of a message, as the guard's events and the framework tell it.

    :param framework: ``"celery"``, ``"dramatiq"`` or ``"python"``.
    :param task: the task or actor name (a function's qualified name for ``"python"``).
    :param message_id: the delivery's message id.
    :param outcome: one of :data:`OUTCOMES`: ``ran``, ``skipped``, ``deferred``, ``failed``,
        ``refused``, ``store_error``, ``unguarded``.
    :param events: the guard's events about this delivery, in order.
    :param result: Celery: the ``EagerResult``; plain Python: the function's return value or
        the skipped run's stored result; Dramatiq: None.
    :param error: the exception of a delivery that failed or was refused.
    """

    framework: str
    task: str
    message_id: str
    outcome: str
    events: tuple[dict[str, Any], ...]
    result: Any = None
    error: BaseException | None = None

    @property
    def names(self) -> list[str]:
        """The names of :attr:`events`."""
        return [e["event"] for e in self.events]

    @property
    def skipped(self) -> bool:
        """Whether the guard skipped it as a duplicate."""
        return self.outcome == "skipped"

    @property
    def ran(self) -> bool:
        """Whether the handler ran and succeeded (guarded or not)."""
        return self.outcome in ("ran", "unguarded")

    def describe(self) -> str:
        """One line: the outcome, the events, the error."""
        text = OUTCOMES.get(self.outcome, self.outcome)
        if self.error is not None:
            text += f" ({type(self.error).__name__}: {self.error})"
        return f"{text}; events: {', '.join(self.names) or 'none'}"


class Twice(NamedTuple):
    """The two deliveries of :func:`deliver_twice`: ``first, second = deliver_twice(...)``."""

    first: DeliveryReport
    second: DeliveryReport

    @property
    def ran_once(self) -> bool:
        """The first delivery ran and the second was skipped."""
        return self.first.outcome == "ran" and self.second.skipped

    def describe(self) -> str:
        """Both deliveries, one line each."""
        return f"  delivery 1: {self.first.describe()}\n  delivery 2: {self.second.describe()}"


def deliver_twice(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    message_id: str | None = None,
    queue: str | None = None,
    guard: Guard | None = None,
    timeout: float = 10.0,
) -> Twice:
    """Deliver the same message (same id) to ``task`` twice, one after the other; report each.

    :param task: a Celery task (run in process with ``task.apply(..., task_id=message_id)``), a
        Dramatiq actor on a ``StubBroker`` (the message enqueued twice and run by a worker,
        with ``max_retries=0`` so a failed delivery is not retried), or a plain function (run
        with ``guard.run``; ``guard=`` is then required).
    :param message_id: the message id of both copies; default a new UUID.
    :param queue: the queue both copies arrive on; default the task's own (``"default"`` for a
        plain function).
    :param guard: default: the guard of the task's app or broker.
    :param timeout: seconds a Dramatiq delivery may take.
    """
    message_id = message_id or str(uuid.uuid4())
    kwargs = dict(kwargs or {})
    framework = _framework(task)
    if framework == "celery":
        deliver = _celery_delivery(task, args, kwargs, message_id, queue)
        guard = guard or _celery_guard(task)
    elif framework == "dramatiq":
        deliver = _dramatiq_delivery(task, args, kwargs, message_id, queue, timeout)
        guard = guard or _dramatiq_guard(task)
    else:
        if guard is None:
            raise ConfigError(
                "deliver_twice(function, …) needs guard=: the guard whose run() delivers it"
            )
        deliver = _python_delivery(guard, task, args, kwargs, message_id, queue or "default")
    name = _task_name(task, framework)
    reports = []
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(_recording(guard)) if guard is not None else EventLog()
        run = stack.enter_context(deliver)
        for _ in range(2):
            start = len(log.events)
            result, error, failed = run()
            events = tuple(e for e in log.events[start:] if _about(e, message_id))
            outcome = _outcome([e["event"] for e in events], failed)
            reports.append(
                DeliveryReport(framework, name, message_id, outcome, events, result, error)
            )
    return Twice(reports[0], reports[1])


#: What one delivery answers: (result, error, failed).
_Run = Callable[[], tuple[Any, BaseException | None, bool]]


def _framework(task: Any) -> str:
    celery = sys.modules.get("celery")
    if celery is not None and isinstance(task, celery.Task):
        return "celery"
    dramatiq = sys.modules.get("dramatiq")
    if dramatiq is not None and isinstance(task, dramatiq.Actor):
        return "dramatiq"
    if callable(task):
        return "python"
    raise ConfigError(
        f"deliver_twice: {task!r} is neither a Celery task, a Dramatiq actor nor a function"
    )


def _task_name(task: Any, framework: str) -> str:
    if framework == "celery":
        return str(task.name)
    if framework == "dramatiq":
        return str(task.actor_name)
    return str(getattr(task, "__qualname__", type(task).__qualname__))


def _outcome(names: Sequence[str], failed: bool) -> str:
    if Event.PAYLOAD_MISMATCH in names:
        return "refused"
    if Event.DUPLICATE_SKIPPED in names:
        return "skipped"
    if Event.IN_PROGRESS_DEFERRED in names:
        return "deferred"
    if failed or Event.RELEASED in names:
        return "failed"
    if Event.COMPLETED in names or Event.MARKED in names or Event.CONCURRENT_DUPLICATE in names:
        return "ran"
    if Event.STORE_ERROR in names:
        return "store_error"
    return "unguarded"


def _celery_guard(task: Any) -> Guard | None:
    from taskonce.celery_ext import guard_for

    try:
        return guard_for(task.app)
    except ConfigError:
        return None  # the delivery fails with the same error; the report says so


@contextlib.contextmanager
def _celery_delivery(
    task: Any, args: Sequence[Any], kwargs: dict[str, Any], message_id: str, queue: str | None
) -> Iterator[_Run]:
    options = {} if queue is None else {"queue": queue}

    def run() -> tuple[Any, BaseException | None, bool]:
        # throw=False: a failure is reported, whatever the app's task_eager_propagates
        result = task.apply(tuple(args), kwargs, task_id=message_id, throw=False, **options)
        failed = result.state == "FAILURE"
        error = result.result if failed and isinstance(result.result, BaseException) else None
        return result, error, failed

    yield run


def _dramatiq_guard(actor: Any) -> Guard | None:
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    for middleware in actor.broker.middleware:
        if isinstance(middleware, IdempotencyMiddleware):
            return middleware.guard
    return None


@contextlib.contextmanager
def _dramatiq_delivery(
    actor: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    message_id: str,
    queue: str | None,
    timeout: float,
) -> Iterator[_Run]:
    import dramatiq

    broker = actor.broker
    if not hasattr(broker, "dead_letters_by_queue"):
        raise ConfigError(
            f"deliver_twice needs Dramatiq's StubBroker; actor {actor.actor_name!r} is on "
            f"{type(broker).__name__} (taskonce.testing.stub_broker(guard) makes one)"
        )
    message = actor.message_with_options(args=tuple(args), kwargs=kwargs, max_retries=0)
    message = message.copy(message_id=message_id)
    if queue is not None:
        broker.declare_queue(queue)
        message = message.copy(queue_name=queue)
    dead = broker.dead_letters_by_queue[message.queue_name]
    worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
    worker.start()

    def run() -> tuple[Any, BaseException | None, bool]:
        before = len(dead)
        broker.enqueue(message)
        _join_all(broker, time.monotonic() + timeout, fail_fast=False)
        worker.join()
        failed = [m for m in dead[before:] if m.message_id == message_id]
        error = getattr(failed[0], "_exception", None) if failed else None
        return None, error, bool(failed)

    try:
        yield run
    finally:
        worker.stop()


@contextlib.contextmanager
def _python_delivery(
    guard: Guard,
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: dict[str, Any],
    message_id: str,
    queue: str,
) -> Iterator[_Run]:
    def run() -> tuple[Any, BaseException | None, bool]:
        try:
            outcome = guard.run(message_id, queue, fn, *args, **kwargs)
        except (InProgressElsewhere, PayloadMismatch) as exc:
            return None, exc, False
        except Exception as exc:
            return None, exc, True
        return outcome.value, None, False

    yield run


def assert_runs_once(
    task: Any,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    message_id: str | None = None,
    queue: str | None = None,
    guard: Guard | None = None,
    timeout: float = 10.0,
) -> Twice:
    """Assert that ``task`` runs the first delivery of a message and skips the second (same
    id): :func:`deliver_twice` (same arguments), then an :class:`AssertionError` that says what
    each delivery did and the likely reason when it is not so. Returns the two reports."""
    twice = deliver_twice(
        task, args, kwargs, message_id=message_id, queue=queue, guard=guard, timeout=timeout
    )
    if twice.ran_once:
        return twice
    first = twice.first
    lines = [
        f"expected {first.task!r} to run once and the second delivery of message "
        f"{first.message_id!r} to be skipped, but:",
        twice.describe(),
    ]
    hint = _hint(task, twice, guard)
    if hint:
        lines.append(hint)
    raise AssertionError("\n".join(lines))


def _hint(task: Any, twice: Twice, guard: Guard | None) -> str:
    """Why a task did not run once, as far as can be told."""
    first, second = twice
    framework = first.framework
    if framework == "celery":
        from taskonce.celery_ext import IdempotentTask
        from taskonce.celery_ext.config import app_state

        if not isinstance(task, IdempotentTask):
            return (
                f"{first.task!r} is not guarded: declare it with "
                "@app.task(base=IdempotentTask, …) (taskonce.celery_ext.IdempotentTask)"
            )
        if guard is None and _celery_guard(task) is None:
            return "its Celery app has no guard: call taskonce.celery_ext.setup(app, guard)"
        if app_state(task.app).eager == "bypass":
            return "the app's taskonce_eager='bypass' setting runs in-process deliveries unguarded"
    if framework == "dramatiq" and guard is None and _dramatiq_guard(task) is None:
        return (
            "its broker has no IdempotencyMiddleware: add "
            "broker.add_middleware(IdempotencyMiddleware(guard)) before declaring the actor"
        )
    if first.outcome == "failed":
        return (
            "the first delivery failed, so the second ran again (a failed run records nothing, "
            "so that a retry can run)"
        )
    if first.outcome == "unguarded" and second.outcome == "unguarded":
        return (
            "no taskonce event for either delivery: the policy in force is disabled "
            "(enabled=False, or the idempotency=False option)"
        )
    return ""


# -- the sends a block made ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CapturedSend:
    """One message a block sent, captured instead of published (:func:`captured_sends`).

    :param framework: ``"celery"`` or ``"dramatiq"`` (``"python"`` for your own senders).
    :param name: the task or actor name.
    :param args: its positional arguments.
    :param kwargs: its keyword arguments.
    :param message_id: the id it would be published under.
    :param queue: the queue named at the send (Celery: the ``queue`` option, if given;
        Dramatiq: the actor's queue).
    :param options: Celery: the publish options (``countdown``, ``eta``, …); Dramatiq: the
        message options, plus ``delay`` when one was given.
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
        if send.framework == "celery":
            from kombu.utils import json as kombu_json

            # kombu's type tags back into datetimes, UUIDs, Decimals, as the publisher does
            args, kwargs = kombu_json.loads(json.dumps([args, kwargs]))  # type: ignore[no-untyped-call]
            name, queue = body.get("task"), options.get("queue")
        else:
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
    ) -> str:
        send_id = super().add(framework, body, message_id, name=name)
        self.found.append(CapturedSend.of(self.sends[-1]))
        return send_id


@contextlib.contextmanager
def captured_sends() -> Iterator[list[CapturedSend]]:
    """``with captured_sends() as sent: ...`` — what the block sends (Celery ``delay``,
    ``apply_async``, ``send_task``, signatures; Dramatiq ``send``, ``send_with_options``,
    ``broker.enqueue``) is captured and listed in ``sent`` (:class:`CapturedSend`), never
    published. The hand-off's own capture does it, so the app or broker must have a guard
    (``setup(app, guard)``; ``IdempotencyMiddleware(guard)``): without one, sends leave as
    usual. Celery's ``task_always_eager`` runs ``delay`` in place instead of sending. Arguments
    that JSON cannot store raise :class:`~taskonce.SendRefused`, as in a guarded handler."""
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
        left = guard.store.pending_sends(0.0, batch)
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
