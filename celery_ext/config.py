"""The guard of a Celery app: :func:`setup`, the ``taskonce_*`` settings, validation.

A Celery app gets its guard either from :func:`setup(app, guard) <setup>` or, on first use, from
its settings:

- ``taskonce_store``: store URL (``redis://…``, ``postgresql+psycopg://…``, ``sqlite:///…``) or a
  :class:`~taskonce.Store`; required unless a guard is given to :func:`setup`.
- ``taskonce_default``: the default :class:`~taskonce.Policy` (or a dict of its fields).
- ``taskonce_queues``: ``{queue: Policy or dict}``, the per-queue policies.
- ``taskonce_events``: extra event sinks: a JSONL file path, an ``EventSink``, or a list of them.
- ``taskonce_eager``: ``"guard"`` (default) guards eager runs (``apply()``,
  ``task_always_eager``) under the queue-name rule's queue; ``"bypass"`` runs them unguarded.
- ``taskonce_store_retry_delay``: seconds before a delivery that met an unreachable store
  (``fail_closed``) is delivered again the first time; doubled (with jitter) for each store
  error in a row, at most 60 s (:class:`taskonce.outage.Backoff`, Dramatiq's rule too);
  default 1.
- ``taskonce_relay_every``: seconds between two sweeps of the worker's hand-off relay, which
  publishes deferred sends left pending by a worker that died after recording an outcome (and
  whose message never comes back, e.g. early acknowledgement); default 30, ``0`` turns it off.
- ``taskonce_start_timeout``: seconds a starting worker waits for its store to answer before it
  refuses to start (exit status 78: a store unreachable at start is almost always a wrong
  URL); default 30.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

from celery.signals import celeryd_after_setup, worker_init, worker_ready

from taskonce import exits
from taskonce.celery_ext.defaults import warn_unsafe_acks
from taskonce.celery_ext.handoff import install
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.events import EventSink, JsonlEvents
from taskonce.exits import EXIT_CONFIG as EXIT_CONFIG  # the adapters' public name
from taskonce.guard import Guard
from taskonce.outage import Backoff
from taskonce.policy import Policy
from taskonce.stores import Store, open_store
from taskonce.worker_options import WorkerOptions

logger = logging.getLogger("taskonce.celery")

EAGER_CHOICES = ("guard", "bypass")
#: Each worker option's setting, as the user writes it (:class:`WorkerOptions`).
SETTINGS = {
    "relay_every": "taskonce_relay_every",
    "start_timeout": "taskonce_start_timeout",
    "backoff_first": "taskonce_store_retry_delay",
}
_UNSET = object()  # ``in conf`` misses a setting under Django's CELERY_ namespace; get finds it


@dataclasses.dataclass
class AppState:
    """What taskonce keeps per Celery app: the guard, adapter options, caches."""

    guard: Guard | None = None
    eager: str = "guard"
    options: WorkerOptions = dataclasses.field(default_factory=WorkerOptions)

    @property
    def backoff(self) -> Backoff:
        """The back-off after a store error: ``taskonce_store_retry_delay`` the first time,
        doubled for each store error in a row, at most 60 s (or the setting, if longer)."""
        return self.options.backoff

    #: effective policy per (task name, queue, time limit)
    policies: dict[tuple[str, str, float | None], Policy] = dataclasses.field(default_factory=dict)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


_STATES: weakref.WeakKeyDictionary[Any, AppState] = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def app_state(app: Any) -> AppState:
    """The taskonce state of ``app`` (created empty on first use)."""
    state = _STATES.get(app)
    if state is None:
        with _STATES_LOCK:
            state = _STATES.get(app)
            if state is None:
                state = AppState()
                _STATES[app] = state
    return state


def worker_options(conf: Mapping[str, Any]) -> WorkerOptions:
    """The worker options of the ``taskonce_*`` settings in ``conf`` (an app's ``conf``)."""
    read = {field: conf.get(name, _UNSET) for field, name in SETTINGS.items()}
    given = {field: value for field, value in read.items() if value is not _UNSET}
    names = {field: f"setting {name}" for field, name in SETTINGS.items()}
    return WorkerOptions(**given, names=names)


def _read_options(app: Any) -> tuple[str, WorkerOptions]:
    conf = app.conf
    eager = conf.get("taskonce_eager", "guard")
    if eager not in EAGER_CHOICES:
        raise ConfigError(
            f"setting taskonce_eager={eager!r} is not valid; choose one of "
            f"{', '.join(EAGER_CHOICES)}"
        )
    return str(eager), worker_options(conf)


def _sinks(value: Any) -> list[EventSink]:
    if value is None:
        return []
    items: Iterable[Any] = value if isinstance(value, (list, tuple)) else [value]
    sinks: list[EventSink] = []
    for item in items:
        if isinstance(item, (str, Path)):
            sinks.append(JsonlEvents(item))
        elif isinstance(item, EventSink):
            sinks.append(item)
        else:
            raise ConfigError(
                f"setting taskonce_events: {item!r} is neither a JSONL file path nor an event "
                "sink (an object with emit(event))"
            )
    return sinks


def guard_from_settings(app: Any) -> Guard:
    """Build a guard from the app's ``taskonce_*`` settings; :class:`ConfigError` when one is
    missing or invalid (the message names the setting)."""
    conf = app.conf
    url = conf.get("taskonce_store")
    if url is None:
        raise ConfigError(
            f"Celery app {app.main!r} has no taskonce guard: call "
            "taskonce.celery_ext.setup(app, guard) or set app.conf.taskonce_store to a store URL"
        )
    default = conf.get("taskonce_default")
    queues = conf.get("taskonce_queues")
    if queues is not None and not isinstance(queues, Mapping):
        raise ConfigError(
            f"setting taskonce_queues must map queue names to policies, not {type(queues).__name__}"
        )
    # Check the policies before a store is opened, so a typo costs no connection.
    try:
        base = Policy().overridden_by(default)
    except ConfigError as exc:
        raise ConfigError(f"setting taskonce_default: {exc}") from None
    for queue, policy in (queues or {}).items():
        try:
            base.overridden_by(policy)
        except ConfigError as exc:
            raise ConfigError(f"setting taskonce_queues[{queue!r}]: {exc}") from None
    sinks = _sinks(conf.get("taskonce_events"))
    if isinstance(url, Store):
        store = url
    elif isinstance(url, str):
        store = open_store(url)
    else:
        raise ConfigError(
            f"setting taskonce_store must be a store URL or a taskonce Store, not "
            f"{type(url).__name__}"
        )
    try:
        return Guard(store, default=default, queues=queues, events=sinks)
    except ConfigError as exc:
        if store is not url:
            store.close()
        raise ConfigError(f"taskonce settings of Celery app {app.main!r}: {exc}") from None


def setup(app: Any, guard: Guard | None = None) -> Guard:
    """Give the Celery ``app`` its guard and check the configuration now.

    :param app: the :class:`celery.Celery` app.
    :param guard: the :class:`~taskonce.Guard`; when omitted it is built from the
        ``taskonce_store`` / ``taskonce_default`` / ``taskonce_queues`` / ``taskonce_events``
        settings.
    :returns: the guard in force.
    :raises ConfigError: an invalid setting, policy or per-task ``idempotency`` option (the
        message names it). Tasks registered later are checked when the app is finalized.
        Called while ``celery worker`` imports the app, the worker refuses to start instead:
        one line, exit status :data:`EXIT_CONFIG`.
    """
    try:
        return _setup(app, guard)
    except ConfigError as exc:
        if worker_starting(app) or _worker_command():
            refuse_start(exc)
        raise


def _worker_command() -> bool:
    """Whether this process is the ``celery … worker`` command (which imports the app module
    before anything else of the worker runs: no signal of Celery's comes earlier)."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    command = program == "celery" or sys.argv[0].endswith(os.path.join("celery", "__main__.py"))
    return command and "worker" in sys.argv[1:]


def _setup(app: Any, guard: Guard | None) -> Guard:
    if guard is not None and not isinstance(guard, Guard):
        raise ConfigError(
            f"setup(app, guard): guard must be a taskonce.Guard, not {type(guard).__name__}"
        )
    eager, options = _read_options(app)
    if guard is None:
        guard = guard_from_settings(app)
    state = app_state(app)
    with state.lock:
        state.guard = guard
        state.eager = eager
        state.options = options
        state.policies.clear()
        install(app, guard)
    if app.finalized:
        check_tasks(app, guard)
    # Otherwise each task is checked when the app binds it (IdempotentTask.on_bound), which
    # raises out of app.finalize(): a worker stops at start instead of running a bad task.
    return guard


def guard_for(app: Any) -> Guard:
    """The guard of ``app``: the one given to :func:`setup`, else built once from settings."""
    state = app_state(app)
    guard = state.guard
    if guard is None:
        with state.lock:
            if state.guard is None:
                state.eager, state.options = _read_options(app)
                state.guard = guard_from_settings(app)
                install(app, state.guard)
            guard = state.guard
    return guard


def relay_guard(app: Any) -> Guard:
    """The guard of ``app`` with its Celery publisher registered, for ``taskonce relay
    --celery-app``: it publishes the deferred sends a worker left pending, no worker needed."""
    return guard_for(app)


def guarded_tasks(app: Any) -> list[Any]:
    """The app's registered tasks whose base is :class:`~taskonce.celery_ext.IdempotentTask`."""
    from taskonce.celery_ext.task import IdempotentTask

    return [task for task in app.tasks.values() if isinstance(task, IdempotentTask)]


def check_tasks(app: Any, guard: Guard) -> None:
    """Check every guarded task's ``idempotency`` option against every policy it can meet."""
    for task in guarded_tasks(app):
        check_task(task, guard)


def check_task(task: Any, guard: Guard) -> None:
    """Check one guarded task's ``idempotency`` option (``task`` is the task or its class)
    against each policy of ``guard``: every named queue's and the default (any other queue),
    since a message can be sent to any queue. :class:`ConfigError` names task, option, queue.
    """
    override = task.idempotency
    if override is None:
        return  # the queues' own policies were checked when the guard was built
    # A queue name the guard has no policy for, so policy_for answers with the default.
    other = " (any other queue)"
    while other in guard.queues:
        other += " "
    for queue in [*guard.queues, other]:
        try:
            guard.policy_for(queue, override)
        except ConfigError as exc:
            where = (
                "any queue without a policy of its own" if queue == other else f"queue {queue!r}"
            )
            raise ConfigError(
                f"task {task.name!r}: idempotency={override!r} on {where}: {exc}"
            ) from None


def refuse_start(exc: Exception) -> NoReturn:
    """Stop a starting worker in one log line, with :data:`EXIT_CONFIG`, before it consumes."""
    exits.refuse_start(exc, logger)


def worker_starting(app: Any) -> bool:
    """Whether ``app`` is being started as a worker (``celery worker`` has begun its start)."""
    return bool(getattr(getattr(app, "loader", None), "worker_initialized", False))


def _check_at_worker_start(sender: Any = None, **_: Any) -> None:
    """In the worker's main process, before the pool forks: build and check the guard of an
    app that has guarded tasks and wait a short time for its store; stop the worker on a
    configuration error or a store that does not answer — a task that can never run must not
    consume (and lose) messages, and they stay in the broker for a worker with the right URL."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        if not guarded_tasks(app):
            return
        guard = guard_for(app)
        check_tasks(app, guard)
        guard.wait_for_store(app_state(app).options.start_timeout)
    except (ConfigError, StoreUnavailable) as exc:
        refuse_start(exc)


def _warn_at_worker_start(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Once per worker, in its main process, once its logging is set up and before it
    consumes: one warning line per guarded task whose run is lost when its process dies
    (``acks_late`` or ``reject_on_worker_lost`` turned off,
    :func:`~taskonce.celery_ext.defaults.warn_unsafe_acks`)."""
    app = getattr(instance, "app", None)
    if app is not None:
        warn_unsafe_acks(guarded_tasks(app))


def _start_relay(sender: Any = None, **_: Any) -> None:
    """Once the worker is ready, in its main process: the hand-off relay of an app that has
    guarded tasks (one sweep per worker, however many pool processes it has)."""
    app = getattr(sender, "app", None)
    if app is None:
        return
    try:
        if not guarded_tasks(app):
            return
        guard = guard_for(app)
        guard.start_relay(app_state(app).options.relay_every)
    except ConfigError as exc:
        logger.critical("taskonce: %s", exc)


worker_init.connect(_check_at_worker_start, weak=False, dispatch_uid="taskonce.celery_ext.init")
celeryd_after_setup.connect(
    _warn_at_worker_start, weak=False, dispatch_uid="taskonce.celery_ext.defaults"
)
worker_ready.connect(_start_relay, weak=False, dispatch_uid="taskonce.celery_ext.relay")
