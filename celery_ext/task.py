"""``IdempotentTask``: a Celery task base class that runs each delivery's body at most once.

The class only translates Celery's moments into the guard's calls (:func:`taskonce.action.before`
before the body, :func:`taskonce.action.after` after it returned, :meth:`taskonce.Guard.fail`
if it raised); every decision is the guard's. What Celery does with each resulting
:class:`~taskonce.action.Action` is the table :data:`CELERY` at the end of this module, the only
place that translation lives; docs/how-it-works.md (*What each framework does with it*) shows
it beside Dramatiq's, and docs/celery.md the Celery moments around it (retries, ``replace``,
captured sends).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import Ignore
from celery.utils.time import get_exponential_backoff_interval

from taskonce.action import Action, Do, after, before
from taskonce.celery_ext import handoff as celery_handoff
from taskonce.celery_ext import request as request_info
from taskonce.celery_ext import retry_hold
from taskonce.celery_ext.config import (
    AppState,
    app_state,
    check_task,
    guard_for,
    refuse_start,
    worker_starting,
)
from taskonce.celery_ext.defaults import check_eta
from taskonce.celery_ext.request import DEFERRED_HEADER, STORE_ERRORS_HEADER
from taskonce.celery_ext.routing import QUEUE_HEADER, delivery_queue, record_refusal
from taskonce.current import handling
from taskonce.errors import ConfigError, InProgressElsewhere
from taskonce.guard import Delivery, Guard, Ticket
from taskonce.handoff import send_now
from taskonce.policy import Policy

logger = logging.getLogger("taskonce.celery")


@dataclasses.dataclass
class _Call:
    """One guarded call, as the table's rows need it."""

    guard: Guard
    state: AppState
    request: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    queue: str
    eager: bool
    #: the link callbacks and chain taken from the request into the capture (put back when the
    #: message is published again to run later)
    links: tuple[Any, Any] = (None, None)


@dataclasses.dataclass
class _Active:
    """The guarded delivery being run by this context (thread/greenlet)."""

    guard: Guard
    ticket: Ticket
    settled: bool = False

    def release(self, exc: BaseException | None = None) -> None:
        """Undo the claim (eager) so a retry can claim again; once."""
        if not self.settled:
            self.settled = True
            self.guard.fail(self.ticket, exc)


_ACTIVE: contextvars.ContextVar[_Active | None] = contextvars.ContextVar(
    "taskonce_celery_active", default=None
)


class IdempotentTask(Task):  # type: ignore[misc]
    """Base class of Celery tasks that run once per ``(queue, task id)``.

    ::

        @app.task(base=IdempotentTask, idempotency={"mode": "lazy"})
        def charge(order_id): ...

    The class sets :attr:`acks_late` and :attr:`reject_on_worker_lost` to ``True``: a message
    is acknowledged only after its body ran, and one whose pool process died mid-body goes back
    to the broker. Both are what make a crash recoverable, and the guard is what makes them
    safe (the copies they bring back are skipped, deferred or take a dead run's claim over).
    A task that turns either off explicitly gets one warning when the worker starts
    (:func:`~taskonce.celery_ext.defaults.warn_unsafe_acks`).

    :attr:`idempotency` overrides the policy of the queue the message arrived on (a dict
    changes only the fields it names; a :class:`~taskonce.Policy` replaces it). Calling the
    task directly (``charge(1)``) is a plain function call and is not guarded.
    """

    #: Per-task policy override: a dict of :class:`~taskonce.Policy` fields or a ``Policy``.
    idempotency: Policy | Mapping[str, Any] | None = None

    #: Acknowledge the message after the body ran, not before: a worker that dies mid-body
    #: leaves it with the broker. Set on the class, so the app's ``task_acks_late`` setting
    #: does not change it (Celery fills a task attribute from the settings only where it is
    #: ``None``); a task's own ``acks_late=False`` does, with a warning at worker start.
    acks_late = True
    #: Give the message back to the broker when the pool process running it dies (``SIGKILL``,
    #: the OOM killer) instead of acknowledging it as ``FAILURE`` (``WorkerLostError``).
    reject_on_worker_lost = True

    #: Refuses messages without a task id before Celery's own strategy (which would crash the
    #: consumer on a missing ``id`` header).
    Strategy = "taskonce.celery_ext.strategy:guarded"

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Check the ``idempotency`` option when the task is bound to its app: its fields, and,
        once :func:`~taskonce.celery_ext.setup` gave the app its guard, every policy it can
        meet. The :class:`ConfigError` raises out of the app's finalize, so a worker stops at
        start."""
        super().on_bound(app)
        try:
            if cls.idempotency is not None:
                try:
                    Policy().overridden_by(cls.idempotency)
                except ConfigError as exc:
                    raise ConfigError(
                        f"task {cls.name!r}: idempotency={cls.idempotency!r}: {exc}"
                    ) from None
            guard = app_state(app).guard
            if guard is not None:
                check_task(cls, guard)
        except ConfigError as exc:
            if worker_starting(app):  # the same one line and exit status as the start check
                refuse_start(exc)
            raise

    # -- the guarded call ------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        state = app_state(self.app)
        eager = bool(request.is_eager)
        guard = state.guard
        if guard is None:  # no setup(): built from the settings on the first delivery
            try:
                guard = guard_for(self.app)
            except ConfigError as exc:
                self._refuse_misconfigured(request, exc, eager)
        if eager and state.eager == "bypass":
            return super().__call__(*args, **kwargs)
        call = _Call(guard, state, request, args, kwargs, delivery_queue(self, request), eager)
        action = before(guard, lambda: self._delivery(call), args, kwargs, state.backoff)
        return CELERY[action.do](self, action, call)

    def _delivery(self, call: _Call) -> Delivery:
        request = call.request
        return Delivery(
            message_id=request.id,
            queue=call.queue,
            task=self.name,
            framework="celery",
            attempt=int(request.retries or 0),
            redelivered=request_info.redelivered(request),
            override=self._policy(call.state, call.guard, call.queue, request),
            deferred=request_info.count(request, DEFERRED_HEADER),
            store_errors=request_info.count(request, STORE_ERRORS_HEADER),
            replaced=celery_handoff.replaced_depth(request),
            encode_payload=celery_handoff.payload_encoding(self, request),
        )

    def _body(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run the body. Celery's tracer has already pushed this task and its request (with
        these ``args``/``kwargs``) when it calls a task with a custom ``__call__``, and calls
        ``run`` itself for a task without one; ``Task.__call__`` would push both a second time
        (a copy of the request per message), so the body is run as the tracer runs a plain
        task's, unless a class between this one and ``Task`` has its own ``__call__``."""
        if _calls_run_directly(type(self)):
            return self.run(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    # -- the rows of the table (CELERY, below the class) -----------------------------------

    def _run(self, action: Action, call: _Call) -> Any:
        """Run the body; record its outcome (:func:`taskonce.action.after`) and act on that."""
        ticket, request = action.ticket, call.request
        assert ticket is not None
        active = _Active(call.guard, ticket)
        token = _ACTIVE.set(active)
        try:
            try:
                with handling(ticket.key):  # taskonce.current_key() in the body
                    result = self._body(call.args, call.kwargs)
                if (
                    ticket.capture is not None
                    and not call.eager
                    and request.id not in retry_hold.HELD
                ):
                    # The tracer publishes these after we return, i.e. after the record: they
                    # are part of this outcome's sends instead.
                    call.links = celery_handoff.capture_links(self, request, result)
                    celery_handoff.capture_chord_part(self, request, result)
            except BaseException as exc:
                active.release(exc)
                raise
            if request.id in retry_hold.HELD:
                # The body caught its own Retry and returned: publish the retry as Celery
                # would have, after releasing the claim; record nothing for this attempt.
                active.release()
                retry_hold.publish_held_retry(request.id)
            elif not active.settled:
                active.settled = True  # after() settles the ticket, whatever it answers
                done = after(call.guard, ticket, result, call.state.backoff)
                CELERY[done.do](self, done, call)
            return result
        finally:
            _ACTIVE.reset(token)

    def _run_unguarded(self, action: Action, call: _Call) -> Any:
        # fail_open: the key the guard would have claimed; enabled=False: None
        with handling(None if action.ticket is None else action.ticket.key):
            return super().__call__(*call.args, **call.kwargs)

    def _ack(self, action: Action, call: _Call) -> None:
        if action.error is not None:  # the body's effects happened; the record is incomplete
            logger.error("taskonce: %s[%s] ran: %s", self.name, call.request.id, action.error)

    def _skip(self, action: Action, call: _Call) -> NoReturn:
        ticket = action.ticket
        if ticket is not None and not action.ran and ticket.policy.store_result:
            logger.info(
                "taskonce: %s[%s] skipped as a duplicate; the first run returned %r",
                self.name,
                call.request.id,
                ticket.stored_result,
            )
        raise Ignore()

    def _redeliver(self, action: Action, call: _Call) -> NoReturn:
        if call.eager:
            assert action.ticket is not None and action.ticket.key is not None
            raise InProgressElsewhere(action.ticket.key, action.delay)
        assert action.ticket is not None
        self._deliver_later(call, action.delay, deferred=action.ticket.delivery.deferred + 1)

    def _back_off(self, action: Action, call: _Call) -> NoReturn:
        assert action.error is not None
        if call.eager:
            raise action.error
        delay = action.delay  # the guard's back-off, longer for each store error in a row
        if action.ran:  # transactional: the body's writes were rolled back with the mark
            logger.warning(
                "taskonce: %s[%s] could not commit (store unreachable); its writes were rolled "
                "back; delivered again in %.1fs",
                self.name,
                call.request.id,
                delay,
            )
        else:  # DEBUG: the guard logs the outage (or the internal error) itself, once
            logger.debug(
                "taskonce: %s[%s] not run, the store is unreachable or failed (fail_closed); "
                "delivered again in %.1fs: %s",
                self.name,
                call.request.id,
                delay,
                action.error,
            )
        self._deliver_later(
            call,
            delay,
            store_errors=request_info.count(call.request, STORE_ERRORS_HEADER) + 1,
        )

    def _refuse(self, action: Action, call: _Call) -> NoReturn:
        exc = action.error
        assert exc is not None
        if isinstance(exc, ConfigError):
            self._refuse_misconfigured(call.request, exc, call.eager)
        how = "rolled back" if action.ran else "not run"
        logger.error("taskonce: %s[%s] refused, %s: %s", self.name, call.request.id, how, exc)
        if call.eager:
            raise exc
        record_refusal(self, call.request.id, exc)  # a quarantined key's: FAILURE, Quarantined
        raise request_info.reject(exc, requeue=False) from exc

    def _lost(self, action: Action, call: _Call) -> NoReturn:
        # Another delivery took the claim over: that one is the run of record, this one is the
        # duplicate. Store nothing, send no callbacks.
        logger.warning(
            "taskonce: %s[%s] lost its claim: %s", self.name, call.request.id, action.error
        )
        raise Ignore() from action.error

    def _raise(self, action: Action, call: _Call) -> NoReturn:
        # The body's failure found at its commit (rolled back, the claim released by the
        # guard): Celery's failure path, as if the body had raised it — the task's
        # autoretry_for, else FAILURE.
        assert action.error is not None
        if action.ran:
            _autoretry(self, action.error)
        raise action.error

    def _refuse_misconfigured(self, request: Any, exc: ConfigError, eager: bool) -> NoReturn:
        """A configuration error met at run time (one that slipped past the start checks): the
        body cannot run, and acknowledging the message (``FAILURE``) would lose it, so it is
        rejected without requeue — dead-lettered where the queue has a dead-letter exchange.
        Eager runs raise the error itself."""
        if eager:
            raise exc
        logger.error(
            "taskonce: %s[%s] not run: configuration error: %s; the message is rejected without "
            "requeue, not acknowledged (dead-lettered where the queue has a dead-letter exchange)",
            self.name,
            request.id,
            exc,
        )
        raise request_info.reject(exc, requeue=False) from exc

    def _policy(self, state: AppState, guard: Guard, queue: str, request: Any) -> Policy:
        """The policy for a delivery on ``queue``: the queue's, this task's option over it, and
        a lease longer than the task's hard time limit unless the option names one."""
        limit = request_info.hard_time_limit(self, request)
        cache_key = (self.name, queue, limit)
        policy = state.policies.get(cache_key)
        if policy is not None:
            return policy
        override = self.idempotency
        try:
            policy = guard.policy_for(queue, override)
        except ConfigError as exc:
            raise ConfigError(
                f"task {self.name!r}: idempotency={override!r} on queue {queue!r}: {exc}"
            ) from None
        if limit is not None and policy.enabled and policy.lease <= limit:
            explicit = isinstance(override, Policy) or (
                isinstance(override, Mapping) and "lease" in override
            )
            if explicit:
                logger.warning(
                    "taskonce: task %s has lease=%ss but a hard time limit of %ss: a claim can "
                    "run out while the body still runs",
                    self.name,
                    policy.lease,
                    limit,
                )
            else:
                policy = policy.replace(lease=request_info.lease_beyond(limit))
        state.policies[cache_key] = policy
        return policy

    def _deliver_later(
        self, call: _Call, delay: float, deferred: int = 0, store_errors: int = 0
    ) -> NoReturn:
        """Publish this message again (same id, same ``retries``, same links and chain) to its
        queue after ``delay`` seconds, then acknowledge this delivery with ``Ignore``.
        ``deferred``: the guard's deferrals of it so far, carried in :data:`DEFERRED_HEADER`;
        ``store_errors``: its back-offs in a row, in :data:`STORE_ERRORS_HEADER` (each counter
        counts consecutive copies of its kind: the other one is dropped)."""
        request = call.request
        celery_handoff.restore_links(request, call.links)  # the copy carries them on
        options: dict[str, Any] = {"queue": call.queue, "countdown": max(delay, 0.0)}
        if deferred or store_errors:
            headers = dict(request.headers) if isinstance(request.headers, Mapping) else {}
            headers.pop(DEFERRED_HEADER, None)
            headers.pop(STORE_ERRORS_HEADER, None)
            name, count = (
                (DEFERRED_HEADER, deferred) if deferred else (STORE_ERRORS_HEADER, store_errors)
            )
            options["headers"] = {**headers, name: count}
        signature = self.signature_from_request(request, call.args, call.kwargs, **options)
        try:
            with send_now():  # the same message again, never a deferred send
                signature.apply_async()
        except Exception as exc:
            logger.error(
                "taskonce: %s[%s] could not be published again (%r); rejecting it back to the "
                "broker instead",
                self.name,
                request.id,
                exc,
            )
            raise request_info.reject(exc, requeue=True) from exc
        raise Ignore()

    # -- Celery moments that publish the same id -------------------------------------------

    def retry(
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """Celery's :meth:`~celery.Task.retry` (and so ``autoretry_for``), reordered so that
        the retry message is published only after this attempt's claim is released *and* its
        ``RETRY`` state is stored.

        Celery publishes the retry inside ``retry()``, before ``Retry`` propagates: a claim
        still held then would make the retry look like a duplicate in progress, and the next
        attempt (``countdown=0``, another pool process) can finish and store ``SUCCESS`` before
        this attempt's ``RETRY`` state lands on top of it. Here the publish is held back; the
        claim is released when ``Retry`` leaves the body and the message is published from
        :meth:`on_retry`, which Celery calls after storing the state. With ``throw=False`` the
        claim is released and the retry published at once, as Celery does.
        """
        request = self.request
        active = _ACTIVE.get()
        ours = active is not None and active.ticket.delivery.message_id == request.id
        hold = ours and throw and not request.is_eager and not request.called_directly
        if ours and not hold:
            self._release_active()
        token = retry_hold.HOLDING.set(request.id) if hold else None
        try:
            return super().retry(
                args=args,
                kwargs=kwargs,
                exc=exc,
                throw=throw,
                eta=eta,
                countdown=countdown,
                max_retries=max_retries,
                **options,
            )
        finally:
            if token is not None:
                retry_hold.HOLDING.reset(token)

    def signature_from_request(
        self, request: Any = None, args: Any = None, kwargs: Any = None, **options: Any
    ) -> Any:
        """Celery's, except that inside :meth:`retry` the signature's publish is held back
        until :meth:`on_retry`."""
        signature = super().signature_from_request(request, args, kwargs, **options)
        task_id = (self.request if request is None else request).id
        if retry_hold.HOLDING.get() == task_id and task_id is not None:

            def hold(*publish_args: Any, **publish_options: Any) -> None:
                del signature.apply_async  # the instance attribute: unpicklable, one use
                retry_hold.HELD[task_id] = (signature, publish_args, publish_options)

            signature.apply_async = hold
        return signature

    def on_retry(
        self, exc: BaseException, task_id: str, args: Any, kwargs: Any, einfo: Any
    ) -> None:
        """Publish the retry held back by :meth:`retry` (Celery calls this after storing the
        ``RETRY`` state). A subclass that overrides it should call ``super().on_retry``; if
        it does not, the ``task_postrun`` receiver publishes the retry instead."""
        super().on_retry(exc, task_id, args, kwargs, einfo)
        retry_hold.publish_held_retry(task_id)

    def replace(self, sig: Any) -> Any:
        """Celery's :meth:`~celery.Task.replace`, handing this delivery over: its claim released,
        its sends so far published after the replacement (:func:`.handoff.replaced`)."""
        active, publish = _ACTIVE.get(), functools.partial(super().replace, sig)
        if active is None or active.settled or active.ticket.delivery.message_id != self.request.id:
            with send_now():  # the replacement carries this task's id: not a deferred send
                return publish()
        active.settled = True  # the replacement's claim: not a release of this run
        return celery_handoff.replaced(active.guard, active.ticket, publish)

    def apply_async(self, *args: Any, **options: Any) -> Any:
        """Celery's :meth:`~celery.Task.apply_async`, with one warning per task and setting when
        a ``countdown``/``eta`` lies beyond the transport's ``visibility_timeout``
        (:func:`~taskonce.celery_ext.defaults.check_eta`)."""
        if options.get("countdown") or options.get("eta"):
            try:
                check_eta(self, options)
            except Exception:  # a warning must never stop a publish
                logger.debug("could not check the ETA of %s", self.name, exc_info=True)
        return super().apply_async(*args, **options)

    def apply(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        """Celery's :meth:`~celery.Task.apply` (eager execution); a ``queue=`` option (as
        ``apply_async`` passes it under ``task_always_eager``) names the queue whose policy
        guards the eager run."""
        queue = options.get("queue")
        name = getattr(queue, "name", queue)
        if isinstance(name, str) and name:
            headers = dict(options.get("headers") or {})
            headers.setdefault(QUEUE_HEADER, name)
            options["headers"] = headers
        return super().apply(args, kwargs, **options)

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """Celery 5.4's Django ``delay_on_commit``: :meth:`delay` once the database
        transaction commits; inside a guarded handler or a ``send_on_commit()`` block, which
        hold the sends until a commit already, at once
        (:func:`taskonce.django_ext.on_commit.publish_on_commit`)."""
        self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """Celery 5.4's Django ``apply_async_on_commit``, as :meth:`delay_on_commit`."""
        from taskonce.django_ext.on_commit import publish_on_commit

        publish_on_commit(self.apply_async, *args, **kwargs)

    def _release_active(self) -> None:
        active = _ACTIVE.get()
        if active is not None and active.ticket.delivery.message_id == self.request.id:
            active.release()


#: What Celery does with each :class:`~taskonce.action.Action` — the only place the translation
#: lives (docs/how-it-works.md, *What each framework does with it*). In an eager run (``apply()``,
#: ``task_always_eager``) ``REDELIVER``, ``BACK_OFF`` and ``REJECT`` raise instead.
CELERY: dict[Do, Callable[[IdempotentTask, Action, _Call], Any]] = {
    Do.RUN: IdempotentTask._run,  # run the body; after(): complete / mark / commit
    Do.RUN_UNGUARDED: IdempotentTask._run_unguarded,  # the body, without a guard
    Do.ACK: IdempotentTask._ack,  # return the result (SUCCESS, callbacks); log a problem
    Do.SKIP: IdempotentTask._skip,  # Ignore: nothing stored, no callbacks, acknowledged
    Do.REDELIVER: IdempotentTask._redeliver,  # publish again, countdown=delay; Ignore
    Do.BACK_OFF: IdempotentTask._back_off,  # the same after the action's back-off delay
    Do.REJECT: IdempotentTask._refuse,  # Reject(requeue=False): dead-lettered (+ FAILURE)
    Do.LOST: IdempotentTask._lost,  # Ignore: the run that took the claim over is of record
    Do.RAISE: IdempotentTask._raise,  # its commit refused: autoretry_for, else FAILURE
}

#: Celery's own ``Task.__call__``, as imported (before any ``add_around`` wrapping).
_CELERY_CALL = Task.__call__
#: Per task class: whether the ``__call__`` after :class:`IdempotentTask`'s is Celery's own.
_DIRECT_RUN: dict[type, bool] = {}


def _calls_run_directly(cls: type) -> bool:
    """Whether ``super(IdempotentTask, task).__call__`` is ``celery.Task.__call__`` (which only
    pushes the task and a copy of its request, then calls ``run``) for tasks of ``cls``."""
    direct = _DIRECT_RUN.get(cls)
    if direct is None:
        mro = cls.__mro__
        after = mro[mro.index(IdempotentTask) + 1 :]
        call = next((vars(k)["__call__"] for k in after if "__call__" in vars(k)), None)
        direct = _DIRECT_RUN[cls] = call is _CELERY_CALL
    return direct


def _autoretry(task: IdempotentTask, exc: BaseException) -> None:
    """Celery's ``autoretry_for`` rule (``celery.app.autoretry``), applied to ``exc`` raised
    after the body returned (its transaction's commit refused): Celery wraps only ``run``, so
    it never sees that error. Raises what ``task.retry`` raises (``Retry``, or ``exc`` itself
    once ``max_retries`` is spent) when the task retries on ``exc``; else returns."""
    autoretry_for = tuple(getattr(task, "autoretry_for", ()) or ())
    dont_autoretry_for = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return
    if dont_autoretry_for and isinstance(exc, dont_autoretry_for):
        return
    options = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False))
    if backoff:
        options["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=task.request.retries,
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    raise task.retry(exc=exc, **options)
