"""Deliver one message twice and report each delivery, from the guard's events: the engine of
:func:`taskonce.testing.deliver_twice` and :func:`taskonce.testing.assert_runs_once`, and the
in-memory event sink they read (:class:`EventLog`). Import them from :mod:`taskonce.testing`.

Celery and Dramatiq are imported only when a helper is given one of their tasks or brokers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from taskonce.errors import ConfigError, InProgressElsewhere, PayloadMismatch
from taskonce.events import Event
from taskonce.guard import Guard

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
def recording(guard: Guard) -> Iterator[EventLog]:
    """A fresh :class:`EventLog` on ``guard`` for the block only."""
    log = EventLog()
    guard.sinks.append(log)
    try:
        yield log
    finally:
        guard.sinks.remove(log)


def join_all(broker: StubBroker, deadline: float, fail_fast: bool) -> None:
    """Wait until every queue of ``broker`` (a ``StubBroker`` a worker consumes) is empty, or
    raise :class:`TimeoutError` at ``deadline`` (``time.monotonic()``) naming the busy ones."""
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
        log = stack.enter_context(recording(guard)) if guard is not None else EventLog()
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
            f"{type(broker).__name__} (taskonce.testing.stub_broker(guard) makes one; with "
            "django_dramatiq, test settings whose DRAMATIQ_BROKER is "
            "dramatiq.brokers.stub.StubBroker with taskonce's middleware: see docs/django.md, "
            "Testing)"
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
        join_all(broker, time.monotonic() + timeout, fail_fast=False)
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


__all__ = [
    "OUTCOMES",
    "DeliveryReport",
    "EventLog",
    "Twice",
    "assert_runs_once",
    "deliver_twice",
    "events_of",
    "join_all",
]
