"""``IdempotencyMiddleware``: Dramatiq's hooks translated into the guard's three calls.

Every decision is the core guard's (:func:`taskonce.action.before` in
``before_process_message``, :func:`taskonce.action.after` once the actor succeeded,
:meth:`taskonce.Guard.fail` otherwise); what Dramatiq sees for each resulting
:class:`~taskonce.action.Action` is the table :data:`DRAMATIQ` at the end of this module, the
only place that translation lives. docs/how-it-works.md (*What each framework does with it*)
shows it beside Celery's.

The skip exceptions derive from ``SkipMessage`` (a ``MiddlewareError``), so ``emit_before``
does not swallow them and the actor never runs; they skip ``Retries`` and ``on_failure``.

Context: ``Guard.begin`` (in ``before_process_message``) sets the context variable behind
:func:`taskonce.current_session` in the worker thread, and ``finish``/``fail`` (in the
``after_*`` hooks) reset it there. A sync actor runs in that same thread, between the two.
An ``async def`` actor runs as a task on the AsyncIO middleware's event-loop thread while the
worker thread waits for it; Dramatiq submits it with ``asyncio.run_coroutine_threadsafe``,
whose ``call_soon_threadsafe`` captures the *calling* thread's context, and the task is
created inside that callback, so it starts with a copy of the worker thread's context: the
session is visible in the coroutine too (``tests/dramatiq`` proves both through real workers).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from dramatiq import Middleware
from dramatiq.common import q_name
from dramatiq.errors import ActorNotFound

from taskonce import current, exits
from taskonce.action import Action, Do, after, before
from taskonce.dramatiq_ext.errors import (
    DuplicateSkipped,
    GuardError,
    InProgressDeferred,
    Rejected,
    StoreDown,
)
from taskonce.dramatiq_ext.failure import fail_as_raised
from taskonce.dramatiq_ext.handoff import (
    Finisher,
    encode_payload,
    install,
    place_finisher,
    sends_after_success,
    wrap_actor,
)
from taskonce.dramatiq_ext.options import ActorPolicies
from taskonce.dramatiq_ext.order import check_order
from taskonce.dramatiq_ext.redelivery import Redelivery, deferrals, store_errors
from taskonce.dramatiq_ext.requeue import requeue_warnings
from taskonce.dramatiq_ext.results import keep_first_result
from taskonce.dramatiq_ext.tickets import TicketBook
from taskonce.dramatiq_ext.worker_options import worker_options
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.exits import EXIT_CONFIG as EXIT_CONFIG  # the adapters' public name
from taskonce.guard import Delivery, Guard, Ticket
from taskonce.handoff import Receipt
from taskonce.keys import make_key
from taskonce.worker_options import WorkerOptions

if TYPE_CHECKING:
    from dramatiq import Actor, Broker, Worker
    from dramatiq.broker import MessageProxy

logger = logging.getLogger("taskonce.dramatiq")

FRAMEWORK = "dramatiq"


def in_worker_process() -> bool:
    """Whether this is a worker process of the ``dramatiq`` command: it imports the broker
    module, which declares the actors, before any hook of the broker runs."""
    if multiprocessing.parent_process() is None or not sys.argv:
        return False
    program = sys.argv[0]
    return os.path.basename(program) == "dramatiq" or program.endswith(
        os.path.join("dramatiq", "__main__.py")
    )


def refuse_start(exc: Exception) -> NoReturn:
    """End a starting worker process in one log line, with :data:`EXIT_CONFIG`."""
    exits.refuse_start(exc, logger)


class IdempotencyMiddleware(Middleware):
    """Runs each Dramatiq message's actor once per key, as the guard decides.

    Add it to the broker *before* declaring actors, after ``Retries``
    (``broker.add_middleware(IdempotencyMiddleware(guard))`` appends, which is right)::

        broker.add_middleware(IdempotencyMiddleware(guard))

        @dramatiq.actor(queue_name="payments", idempotency={"mode": "lazy"})
        def charge(order_id): ...

    :param guard: the :class:`taskonce.Guard` that decides; its per-queue policies are looked up
        by the *canonical* queue name (``payments.DQ`` and ``payments.XQ`` are ``payments``).
    :param store_error_min_backoff: milliseconds before a delivery that found the store
        unreachable (``fail_closed``) is tried again; doubled, with jitter, per consecutive
        failure (:class:`taskonce.outage.Backoff`, the same rule as Celery's). Default 1000.
    :param store_error_max_backoff: the cap of that backoff in milliseconds. Default 60000.
    :param relay_every: seconds between two sweeps of each worker process's hand-off relay,
        which enqueues deferred sends left pending by a worker that died after recording an
        outcome; default 30, ``0`` turns it off.
    :param start_timeout: seconds a worker process started by the ``dramatiq`` command waits
        for the store to answer before the worker refuses to start (exit status 78: a store
        unreachable at start is almost always a wrong URL); default 30.

    A keyword left out keeps its default (:meth:`default_options`; for
    :class:`taskonce.django_ext.IdempotencyMiddleware`, ``settings.TASKONCE``'s). A bad value
    is a :class:`~taskonce.ConfigError` naming it: ``IdempotencyMiddleware(relay_every=-1)
    must be a number of seconds, 0 or more``.
    """

    def __init__(
        self,
        guard: Guard,
        *,
        store_error_min_backoff: int | None = None,
        store_error_max_backoff: int | None = None,
        relay_every: float | None = None,
        start_timeout: float | None = None,
    ) -> None:
        if not isinstance(guard, Guard):
            raise ConfigError(
                f"IdempotencyMiddleware(guard=…) needs a taskonce.Guard, not {type(guard).__name__}"
            )
        self.guard = guard
        keywords = {
            "store_error_min_backoff": store_error_min_backoff,
            "store_error_max_backoff": store_error_max_backoff,
            "relay_every": relay_every,
            "start_timeout": start_timeout,
        }
        #: relay interval, start timeout, the back-off after a store error (checked here)
        self.options = worker_options(keywords, self.default_options())
        #: set in a worker process of the ``dramatiq`` command (after_process_boot), where a
        #: configuration error ends the process with EXIT_CONFIG instead of a traceback
        self._in_cli_worker = False
        #: successful deliveries whose outcome the finisher records, after Pipelines/Callbacks
        self.finishing = TicketBook()
        self.finisher = Finisher(self)
        self.policies = ActorPolicies(guard)
        self.tickets = TicketBook()
        self.redelivery = Redelivery()
        self._declared_here: set[str] = set()
        self._queues: dict[str, str] = {}
        self._requeue_warned = False

    def default_options(self) -> WorkerOptions:
        """The options a keyword left out keeps (Django's middleware: ``settings.TASKONCE``)."""
        return WorkerOptions()

    @property
    def actor_options(self) -> set[str]:
        """``idempotency`` (see :mod:`taskonce.dramatiq_ext.options`)."""
        return set(ActorPolicies.actor_options)

    # -- declaration -----------------------------------------------------------------------

    def attach(self, broker: Broker) -> None:
        """Capture sends on ``broker``, publish them through it, and put the finisher first."""
        install(broker, self.guard, functools.partial(self.receipt_of, broker))
        place_finisher(broker, self.finisher)

    def receipt_of(self, broker: Broker, message: Any, delay: int | None) -> Receipt | None:
        """Where the receipt of ``message``, published with ``delay`` ms, shows: the key this
        middleware's guard claims for it, when its actor is declared on ``broker`` and guarded;
        else None (taskonce cannot see that receiver)."""
        try:
            policy = self.policies.for_name(broker, message.actor_name)
        except (ActorNotFound, ConfigError):  # the message left: never fail its publish now
            return None
        if policy is None or not policy.enabled:
            return None
        key = make_key(message.message_id, self._canonical(message.queue_name), policy.identity)
        return Receipt(key, policy.keep_for, max(0, delay or 0) / 1000.0)

    def after_process_boot(self, broker: Broker) -> None:
        """In a worker process of the ``dramatiq`` command, before its actors are imported: wait
        up to ``start_timeout`` for the store, else end the process with :data:`EXIT_CONFIG`
        (the main process then stops the others and exits with it); nothing is consumed."""
        self._in_cli_worker = True
        try:
            self.guard.wait_for_store(self.options.start_timeout)
        except (ConfigError, StoreUnavailable) as exc:
            refuse_start(exc)

    def before_declare_actor(self, broker: Broker, actor: Actor[Any, Any]) -> None:
        """Refuse a bad ``idempotency`` option or a wrong middleware order at declaration."""
        try:
            check_order(broker, self)
            self.attach(broker)
            wrap_actor(actor)
            self.policies.forget(actor.actor_name)
            self.policies.resolve(actor)
        except ConfigError as exc:
            if self._in_cli_worker or in_worker_process():
                refuse_start(exc)
            raise
        self._declared_here.add(actor.actor_name)

    def after_declare_actor(self, broker: Broker, actor: Actor[Any, Any]) -> None:
        """Warn about actors declared before this middleware was added.

        ``broker.add_middleware`` calls this (and not ``before_declare_actor``) for every actor
        that already exists, so an actor not seen before was declared too early.
        """
        self.attach(broker)
        wrap_actor(actor)
        if actor.actor_name not in self._declared_here:
            check_order(broker, self)
            logger.warning(
                "actor %r was declared before IdempotencyMiddleware was added to the broker: it "
                "is guarded with the policy of queue %r, but it could not take an "
                "idempotency= option. Add the middleware before declaring actors.",
                actor.actor_name,
                q_name(actor.queue_name),
            )
            self._declared_here.add(actor.actor_name)
            self.policies.resolve(actor)

    def before_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Refuse to start a worker whose middleware order is wrong or one of whose actors has
        an ``idempotency`` option no policy can take (checked again here: an actor declared
        before the middleware was added is resolved only now)."""
        try:
            check_order(broker, self)
            for actor in list(broker.actors.values()):
                self.policies.resolve(actor)
        except ConfigError as exc:
            if self._in_cli_worker:
                refuse_start(exc)
            raise
        self.attach(broker)

    def after_worker_boot(self, broker: Broker, worker: Worker) -> None:
        """Start this process's hand-off relay (every ``relay_every`` seconds); say where the
        broker's settings lose a killed process's messages."""
        self.guard.start_relay(self.options.relay_every)
        self._warn_requeue(broker)

    def _warn_requeue(self, broker: Broker) -> None:
        """Once per worker: log each broker setting that keeps a dead worker process's messages
        from coming back (:func:`~taskonce.dramatiq_ext.requeue.requeue_warnings`). The
        ``dramatiq`` command boots all its worker processes alike, so only the first speaks:
        they are the first processes it starts, which multiprocessing names Process-1…N."""
        if self._requeue_warned or (
            in_worker_process() and multiprocessing.current_process().name != "Process-1"
        ):
            return
        self._requeue_warned = True
        try:
            actors = [(n, self.policies.for_name(broker, n)) for n in sorted(broker.actors)]
            lines = requeue_warnings(broker, actors)
        except Exception:  # a warning must never stop a worker's start
            logger.debug("could not check the broker's requeue settings", exc_info=True)
            return
        for line in lines:
            logger.warning(line)

    # -- processing ------------------------------------------------------------------------

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        """Ask the guard whether this delivery runs; raise a skip when it does not."""
        if message.failed:
            return  # an earlier middleware failed it: the actor will not run, nothing to claim
        # The message's fields read from the Message itself: each read through the proxy goes
        # through MessageProxy.__getattr__, nine of them per delivery.
        msg = _message_of(message)
        action = before(
            self.guard,
            lambda: self._delivery(broker, message, msg),
            msg.args,
            msg.kwargs,
            self.options.backoff,
        )
        DRAMATIQ[action.do][0](self, broker, message, action)
        # The actor runs (the rows that do not raise): taskonce.current_key() in this thread
        # until after_process_message/after_skip_message (fail_open: the key it would claim).
        current.enter(None if action.ticket is None else action.ticket.key)

    def _delivery(self, broker: Broker, message: MessageProxy, msg: Any) -> Delivery | None:
        policy = self.policies.for_name(broker, msg.actor_name)
        if policy is None:
            return None  # idempotency=False
        return Delivery(
            message_id=msg.message_id,
            queue=self._canonical(msg.queue_name),
            task=msg.actor_name,
            framework=FRAMEWORK,
            attempt=int(msg.options.get("retries", 0)),
            redelivered=_redelivered(message),
            override=policy,
            deferred=deferrals(msg.options),
            store_errors=store_errors(msg.options),
            encode_payload=encode_payload,
        )

    def _canonical(self, queue_name: str) -> str:
        """``q_name(queue_name)`` (``q.DQ``/``q.XQ`` are ``q``), remembered per name."""
        queue = self._queues.get(queue_name)
        if queue is None:
            queue = self._queues[queue_name] = q_name(queue_name)
        return queue

    def _put_back_after_store_error(
        self, broker: Broker, message: MessageProxy, exc: Exception, backoff: float
    ) -> NoReturn:
        try:
            delay = self.redelivery.after_store_error(broker, message, backoff)
        except Exception as enqueue_exc:
            raise GuardError(
                f"store unreachable ({exc}) and the broker refused the redelivery of message "
                f"{message.message_id!r} ({enqueue_exc}); it was not run"
            ) from enqueue_exc
        # DEBUG: the guard logs the outage itself, once per change (taskonce.outage).
        logger.debug(
            "store unreachable; message %s not run (fail_closed), delivered again in %d ms: %s",
            message.message_id,
            delay,
            exc,
        )
        keep_first_result(message)
        raise StoreDown(str(exc)) from exc

    def _reject(self, message: MessageProxy, exc: Exception) -> NoReturn:
        reason = "configuration error: " if isinstance(exc, ConfigError) else ""
        # %r: an empty or missing id shows as '' or None, never as a blank.
        logger.error("message %r dead-lettered, not run: %s%s", message.message_id, reason, exc)
        keep_first_result(message)
        message.fail()
        raise Rejected(str(exc)) from exc

    def after_process_message(
        self,
        broker: Broker,
        message: MessageProxy,
        *,
        result: Any | None = None,
        exception: BaseException | None = None,
    ) -> None:
        """Record the outcome of a delivery this middleware began: finish on success, fail
        (release) on an exception or when the actor did not run."""
        current.leave()
        ticket = self.tickets.take(message)
        if ticket is None:
            return
        if (
            exception is None
            and not message.failed
            and ticket.capture is not None
            and sends_after_success(broker, message)
            and broker.middleware[:1] == [self.finisher]
        ):
            # Pipelines', Callbacks' and GroupCallbacks' after_* hooks run after this one: their
            # sends belong to this outcome, so the finisher (last to run) records it.
            self.finishing.hold(message, ticket)
            return
        self.settle(broker, message, ticket, result, exception)

    def settle(
        self,
        broker: Broker,
        message: MessageProxy,
        ticket: Ticket,
        result: Any,
        exception: BaseException | None,
    ) -> None:
        """Finish a successful delivery; fail one that raised or that a middleware failed."""
        if exception is not None or message.failed:
            # message.failed without an exception: a middleware after this one failed it, so
            # the actor did not run. Releasing is safe either way: a redelivery runs again.
            self.guard.fail(ticket, exception)
            return
        self._finish(broker, message, ticket, result)

    def _finish(self, broker: Broker, message: MessageProxy, ticket: Ticket, result: Any) -> None:
        action = after(self.guard, ticket, result, self.options.backoff)
        DRAMATIQ[action.do][1](self, broker, message, action)

    # -- the rows of the table (DRAMATIQ, below the class) ---------------------------------

    def _hold(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        assert action.ticket is not None
        self.tickets.hold(message, action.ticket)

    def _as_is(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        """Nothing to do: the actor runs (unguarded), or the outcome is recorded."""
        if action.error is not None:  # recorded without its result, or not at all
            logger.error("message %s ran: %s", message.message_id, action.error)

    def _skip(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        keep_first_result(message)  # the first run's stored result stays
        if not action.ran:
            key = None if action.ticket is None else action.ticket.key
            raise DuplicateSkipped(f"duplicate of {key!r}: already handled")

    def _defer(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        key = None if action.ticket is None else action.ticket.key
        try:
            delay = self.redelivery.after_lease(broker, message, action.delay)
        except Exception as exc:
            if not action.ran:
                raise GuardError(
                    f"could not enqueue the deferred copy of {key!r} ({exc}); it was not run"
                ) from exc
            logger.exception(
                "message %s: rolled back behind a claim in progress, and the redelivery "
                "failed; it is NOT recorded",
                message.message_id,
            )
        keep_first_result(message)
        if not action.ran:
            raise InProgressDeferred(
                f"{key!r} is being processed elsewhere; delivered again in {delay} ms"
            )

    def _back_off(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        if not action.ran:  # the store unreachable, or an internal error (taskonce.action)
            assert isinstance(action.error, Exception)
            self._put_back_after_store_error(broker, message, action.error, action.delay)
        # The actor's transaction was rolled back with the mark (the guard released the
        # claim): run it again later.
        try:
            delay = self.redelivery.after_store_error(broker, message, action.delay)
        except Exception:
            logger.exception(
                "message %s: transaction rolled back (%s) and the redelivery failed; its "
                "effects are NOT recorded",
                message.message_id,
                action.error,
            )
            return
        key = None if action.ticket is None else action.ticket.key
        logger.warning(
            "message %s: transaction of %s rolled back (%s); delivered again in %d ms",
            message.message_id,
            key,
            action.error,
            delay,
        )

    def _dead_letter(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        assert isinstance(action.error, Exception)
        if not action.ran:
            self._reject(message, action.error)
        # Lazy transactional: found at the mark, the actor's writes and sends rolled back.
        logger.error("message %r dead-lettered, rolled back: %s", message.message_id, action.error)
        keep_first_result(message)
        message.fail()

    def _lost(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        # Emitted by the guard. Transactional: nothing committed; the owner that took the
        # claim over commits. Otherwise the actor's effects stand beside the other run's.
        key = None if action.ticket is None else action.ticket.key
        logger.warning("lease of %s was lost while message %s ran", key, message)

    def _error(self, broker: Broker, message: MessageProxy, action: Action) -> None:
        error = action.error
        if not action.ran:
            logger.error(
                "the guard could not decide on message %s",
                message.message_id,
                exc_info=error,
            )
            raise GuardError(
                f"taskonce could not decide whether to run message {message.message_id!r} "
                f"({type(error).__name__}: {error}); it was not run"
            ) from error
        assert error is not None
        # The actor's failure found at its commit (rolled back, the claim released by the
        # guard): Dramatiq's failure path, as if the actor had raised it (Retries, on_failure).
        fail_as_raised(broker, message, error)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        """A middleware after this one skipped a delivery this middleware claimed: release."""
        current.leave()
        ticket = self.tickets.take(message)
        if ticket is not None:
            self.guard.fail(ticket)


#: What Dramatiq does with each :class:`~taskonce.action.Action` — the only place the
#: translation lives (docs/how-it-works.md, *What each framework does with it*): before the
#: actor runs (``before_process_message``) and after it succeeded (``after_process_message``
#: or the finisher). The skips raise a ``SkipMessage``: the actor does not run, no retry counted.
_Row = Callable[["IdempotencyMiddleware", "Broker", "MessageProxy", Action], None]
DRAMATIQ: dict[Do, tuple[_Row, _Row]] = {
    Do.RUN: (IdempotencyMiddleware._hold, IdempotencyMiddleware._as_is),
    Do.RUN_UNGUARDED: (IdempotencyMiddleware._as_is, IdempotencyMiddleware._as_is),
    Do.ACK: (IdempotencyMiddleware._as_is, IdempotencyMiddleware._as_is),
    Do.SKIP: (IdempotencyMiddleware._skip, IdempotencyMiddleware._skip),  # DuplicateSkipped
    Do.REDELIVER: (IdempotencyMiddleware._defer, IdempotencyMiddleware._defer),  # a delayed copy
    Do.BACK_OFF: (IdempotencyMiddleware._back_off, IdempotencyMiddleware._back_off),  # StoreDown
    Do.REJECT: (IdempotencyMiddleware._dead_letter, IdempotencyMiddleware._dead_letter),
    Do.LOST: (IdempotencyMiddleware._lost, IdempotencyMiddleware._lost),
    Do.RAISE: (IdempotencyMiddleware._error, IdempotencyMiddleware._error),  # GuardError
}


def _message_of(message: MessageProxy) -> Any:
    """The :class:`dramatiq.Message` behind a proxy (the proxy itself where it has none)."""
    return vars(message).get("_message", message)


def _redelivered(message: MessageProxy) -> bool | None:
    """The broker's redelivery flag: RabbitMQ's ``basic.deliver`` ``redelivered``; None where
    the broker does not tell (Redis)."""
    # Read the proxy's own attributes: a plain getattr would fall through MessageProxy's
    # __getattr__ to the Message and raise (and catch) an AttributeError on every delivery.
    flag = vars(message).get("redelivered")
    return flag if isinstance(flag, bool) else None


def relay_guard(broker: Broker) -> Guard:
    """The guard of ``broker``'s :class:`IdempotencyMiddleware` with its publisher registered,
    for ``taskonce relay --dramatiq-broker``: it enqueues the deferred sends a worker left
    pending, no worker needed."""
    for middleware in broker.middleware:
        if isinstance(middleware, IdempotencyMiddleware):
            middleware.attach(broker)
            return middleware.guard
    raise ConfigError(
        f"{broker!r} has no IdempotencyMiddleware: add it with "
        "broker.add_middleware(IdempotencyMiddleware(guard))"
    )
