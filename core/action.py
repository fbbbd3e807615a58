"""The outcome of a delivery as one small type: what an adapter does with the message.

:func:`before` asks the guard before the handler runs, :func:`after` records a successful run;
each answers one :class:`Action`. Every framework maps the kinds (:class:`Do`) onto its own
words in one table — ``celery_ext/task.py`` and ``dramatiq_ext/middleware.py`` — and nowhere
else; docs/how-it-works.md (*What each framework does with it*) shows both in one table.

An unexpected error inside the guard or the store (a bug, an incompatible driver) is never the
handler's failure: before the handler it is treated as a store outage (``on_store_error``:
``fail_closed`` backs off, ``fail_open`` runs unguarded), after it as an outcome the store could
not record; :mod:`taskonce.internal` logs each distinct one with its traceback once.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from taskonce import internal
from taskonce.errors import (
    ConfigError,
    InvalidInput,
    LeaseLost,
    PayloadMismatch,
    Quarantined,
    StoreUnavailable,
)
from taskonce.events import Event
from taskonce.keys import make_key
from taskonce.outage import DEFAULT_BACKOFF, Backoff
from taskonce.record import is_handlers_own
from taskonce.ticket import Decision, Delivery, Ticket, ticket_event

if TYPE_CHECKING:
    from collections.abc import Mapping

    from taskonce.guard import Guard


class Do(str, enum.Enum):
    """What to do with a delivery."""

    RUN = "run"  # run the handler, then after() (or Guard.fail when it raises)
    RUN_UNGUARDED = "run_unguarded"  # run it without a guard (disabled, or store down fail_open)
    ACK = "ack"  # the outcome is recorded: acknowledge as the framework does after a success
    SKIP = "skip"  # a duplicate: acknowledge; no result stored, no callbacks, no retry
    REDELIVER = "redeliver"  # in progress elsewhere: the same message again after ``delay`` s
    BACK_OFF = "back_off"  # store unreachable or failing (fail_closed): again after a backoff
    REJECT = "reject"  # never runnable (payload mismatch, bad id, config error, quarantined): DLQ
    LOST = "lost"  # the claim was taken over while the handler ran: the other run is of record
    RAISE = "raise"  # the handler's failure at its commit: the framework's failure path


@dataclasses.dataclass(frozen=True)
class Action:
    """One delivery's outcome: what to do (``do``), and with what.

    :param do: the kind.
    :param ticket: the guard's ticket, when it made one.
    :param delay: :attr:`Do.REDELIVER` and :attr:`Do.BACK_OFF`: seconds until the copy is
        delivered (a back-off's from :class:`~taskonce.outage.Backoff`, the same rule for
        every framework).
    :param error: the exception behind ``BACK_OFF``, ``REJECT``, ``LOST`` and ``RAISE``; on
        ``ACK``, a problem to log (the result could not be stored, or, outside a transaction,
        the outcome could not be recorded).
    :param ran: the handler ran (the action comes from :func:`after`). Its ticket is then
        settled (:attr:`Ticket.settled`): the adapter acts on the action and never calls
        :meth:`Guard.fail` after it.
    """

    do: Do
    ticket: Ticket | None = None
    delay: float = 0.0
    error: BaseException | None = None
    ran: bool = False


def before(
    guard: Guard,
    delivery: Callable[[], Delivery | None],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    backoff: Backoff = DEFAULT_BACKOFF,
) -> Action:
    """Ask ``guard`` what to do with a delivery before its handler runs. ``delivery()`` builds
    it (a configuration error there is refused like the guard's own); None: not guarded.
    ``backoff`` gives a ``BACK_OFF`` its ``delay``, by the delivery's ``store_errors``."""
    described: list[Delivery | None] = []

    def describe() -> Delivery | None:
        described.append(delivery())
        return described[-1]

    action = _decide(guard, describe, args, kwargs)
    if action.do is Do.BACK_OFF:  # the one back-off rule of every framework
        last = described[-1] if described else None  # None: delivery() raised
        return dataclasses.replace(action, delay=_backoff(backoff, last))
    return action


def _backoff(backoff: Backoff, delivery: Delivery | None) -> float:
    """Seconds before a delivery backed off is tried again."""
    return backoff.delay(0 if delivery is None else delivery.store_errors)


def _decide(
    guard: Guard,
    delivery: Callable[[], Delivery | None],
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
) -> Action:
    """:func:`before`'s answer, but a ``BACK_OFF``'s delay.

    An unexpected error (not a :class:`~taskonce.TaskonceError` the guard means) is an outage:
    see :func:`_internal_error`."""
    described: Delivery | None = None
    try:
        described = delivery()
        if described is None:
            return Action(Do.RUN_UNGUARDED)
        ticket = guard.begin(described, args, kwargs)
    except StoreUnavailable as exc:  # on_store_error="fail_closed"
        return Action(Do.BACK_OFF, error=exc)
    except (InvalidInput, PayloadMismatch, ConfigError, Quarantined) as exc:
        return Action(Do.REJECT, error=exc)
    except Exception as exc:
        return _internal_error(guard, described, exc)
    return _of(ticket, ran=False)


def _internal_error(guard: Guard, described: Delivery | None, exc: Exception) -> Action:
    """An unexpected error before the handler ran, handled like a store outage: logged (its
    traceback once per distinct error), a ``store_error`` event with ``reason``
    ``"internal_error"``, and then ``on_store_error``: ``fail_closed`` backs off (the message
    goes back to the broker for a later try), ``fail_open`` runs the handler unguarded. Never
    the task's failure: acknowledging it as failed would lose a message that never ran."""
    ticket: Ticket | None = None
    if described is not None:
        try:
            policy = guard.policy_for(described.queue, described.override)
            key = make_key(described.message_id, described.queue, policy.identity)
            ticket = Ticket(described, policy, Decision.UNGUARDED, key=key)
        except Exception:  # noqa: S110 - the policy is unknown: fail closed, below
            pass
    name = described.task if described is not None and described.task else "a message"
    which = f"{name}[{described.message_id}]" if described is not None else name
    fail_open = ticket is not None and ticket.policy.on_store_error == "fail_open"
    then = (
        "running it unguarded (on_store_error=fail_open)"
        if fail_open
        else "it was not run and goes back to the broker for a later try (fail_closed)"
    )
    internal.report(exc, f"before running {which}", then)
    if ticket is not None and not guard.sinks.quiet(Event.STORE_ERROR):
        guard.sinks.send(ticket_event(Event.STORE_ERROR, ticket, reason="internal_error"))
    if fail_open:
        return Action(Do.RUN_UNGUARDED, ticket)
    return Action(Do.BACK_OFF, error=exc)


def after(guard: Guard, ticket: Ticket, result: Any, backoff: Backoff = DEFAULT_BACKOFF) -> Action:
    """Record the successful run of ``ticket``'s handler (:meth:`Guard.finish`) and say what
    to do with the message. The ticket is settled after this, whatever it answers: a
    transactional run that could not commit was rolled back and its claim released, once, by
    the guard. What follows is decided here, the same for every framework:

    - a store that failed at the commit (unreachable) backs off: the writes are gone, it must
      run again, and that is not the handler's failure (no retry counted);
    - a commit the handler's own writes refused (a constraint checked at commit, Django's
      rollback-only transaction) is the handler's failure, ``RAISE``: the framework's failure
      path, with its own retry rules, exactly as if the handler had raised it.

    An unexpected error while recording is treated as the store failing: outside a transaction
    the handler's effects stand unrecorded (acknowledged, logged); in one they were rolled back
    (the guard released the claim), so it backs off and runs again."""
    try:
        guard.finish(ticket, result)
    except LeaseLost as exc:
        return Action(Do.LOST, ticket, error=exc, ran=True)
    except StoreUnavailable as exc:
        if not ticket.policy.transactional:
            return Action(Do.ACK, ticket, error=exc, ran=True)  # effects stand, unrecorded
        delay = _backoff(backoff, ticket.delivery)
        return Action(Do.BACK_OFF, ticket, delay, exc, ran=True)  # rolled back, released
    except InvalidInput as exc:  # store_result and a result JSON cannot hold: recorded without
        return Action(Do.ACK, ticket, error=exc, ran=True)
    except PayloadMismatch as exc:  # found at a transactional mark, rolled back
        return Action(Do.REJECT, ticket, error=exc, ran=True)
    except Exception as exc:
        if is_handlers_own(exc):  # rolled back, the claim released: the framework's failure
            return Action(Do.RAISE, ticket, error=exc, ran=True)
        transactional = ticket.policy.transactional
        then = (
            "its writes were rolled back and it goes back to the broker to run again"
            if transactional
            else "it ran, but its outcome is not recorded (a redelivery may run it again)"
        )
        internal.report(exc, f"recording {ticket.delivery.task}[{ticket.key}]", then)
        if transactional:  # Guard.finish rolled it back and released the claim already
            delay = _backoff(backoff, ticket.delivery)
            return Action(Do.BACK_OFF, ticket, delay, exc, ran=True)
        return Action(Do.ACK, ticket, ran=True)  # logged above: effects stand, unrecorded
    return _of(ticket, ran=True)


def _of(ticket: Ticket, ran: bool) -> Action:
    """The action of the guard's decision (after a transactional run, the decision may have
    turned into a skip or a deferral)."""
    decision = ticket.decision
    if decision is Decision.RUN:
        return Action(Do.ACK if ran else Do.RUN, ticket, ran=ran)
    if decision is Decision.UNGUARDED:
        return Action(Do.RUN_UNGUARDED, ticket)
    if decision is Decision.SKIP:
        return Action(Do.SKIP, ticket, ran=ran)
    return Action(Do.REDELIVER, ticket, delay=ticket.retry_after, ran=ran)
