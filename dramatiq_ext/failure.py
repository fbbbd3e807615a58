"""Dramatiq's failure path for an actor whose transaction's commit was refused.

In transactional mode the actor's writes commit after it returned, from
``after_process_message`` (or the finisher). When the database refuses that commit on the
actor's account (a constraint checked at commit, Django's rollback-only transaction), the guard
rolls it back and releases the claim, and :func:`taskonce.action.after` answers ``RAISE``: the
actor's failure. By then Dramatiq has called the actor a success and its ``after_*`` hooks are
under way with ``exception=None``, so the failure is given to the middleware that acts on one
here, as if the actor had raised it: ``Retries`` (the actor's ``max_retries``, ``retry_when``,
``throws``, ``min_backoff``/``max_backoff``: retried later, or failed and dead-lettered once
spent) and ``Callbacks`` (``on_failure``). Without ``Retries`` the message is acknowledged, as
Dramatiq does with an exception then.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from dramatiq.middleware import Callbacks, Retries

from taskonce.dramatiq_ext.results import keep_first_result
from taskonce.handoff import send_now

if TYPE_CHECKING:
    from dramatiq import Broker
    from dramatiq.broker import MessageProxy

logger = logging.getLogger("taskonce.dramatiq")

#: The middleware whose ``after_process_message`` acts on a failed actor.
FAILURE_HOOKS = (Retries, Callbacks)


def fail_as_raised(broker: Broker, message: MessageProxy, exc: BaseException) -> None:
    """Give ``message`` Dramatiq's failure path for ``exc``, raised at its actor's commit."""
    logger.error(
        "message %s failed at the commit of its transaction (rolled back): %s: %s",
        message.message_id,
        type(exc).__name__,
        exc,
    )
    message.stuff_exception(exc)  # as the worker does with an actor's exception
    for middleware in broker.middleware:
        if not isinstance(middleware, FAILURE_HOOKS):
            continue
        try:
            try:
                raise exc  # caught at once: Retries' traceback.format_exc() sees this error
            except BaseException:
                with send_now():  # a retry, an on_failure message: never a captured send
                    middleware.after_process_message(  # type: ignore[no-untyped-call]
                        broker, message, exception=exc
                    )
        except Exception:  # as Dramatiq's emit_after: one middleware's error stops no other
            logger.exception("%r failed on message %s", middleware, message.message_id)
    if not message.failed:
        # Retried (or no Retries): the Results middleware, whose hook may run after this one,
        # must not store this failed attempt's return value as the message's result.
        keep_first_result(message)
