"""Sending a delivery back to the broker for a later try, outside ``Retries``.

Two outcomes of the guard put a message back instead of running it: a duplicate whose key
another live owner is processing (deliver again when that owner's lease would run out) and a
store that cannot be reached under ``fail_closed`` (deliver again after the guard's back-off,
:class:`taskonce.outage.Backoff`, longer for each store error in a row). Neither is
the message's failure, so neither goes through ``Retries``: ``message.options["retries"]`` is
left as it is, ``max_retries`` is never exhausted by them, and no ``on_failure`` callback
fires. The copy is enqueued *before* the current delivery is acknowledged, so a crash between
the two leaves two copies of one message id (which the guard handles), never none.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from dramatiq.common import q_name

from taskonce.handoff import send_now

if TYPE_CHECKING:
    from dramatiq.broker import Broker, MessageProxy

#: The message option counting consecutive store-unavailable redeliveries of one message.
STORE_ERRORS_OPTION = "taskonce_store_errors"
#: The message option counting the guard's deferrals of one message (in progress elsewhere):
#: the audit counts a re-deferred copy as one duplicate.
DEFERRED_OPTION = "taskonce_deferred"


def deferrals(options: dict[str, object]) -> int:
    """How many times the guard deferred this copy before (:data:`DEFERRED_OPTION`)."""
    return _count(options, DEFERRED_OPTION)


def store_errors(options: dict[str, object]) -> int:
    """How many times in a row this copy was put back after a store error
    (:data:`STORE_ERRORS_OPTION`)."""
    return _count(options, STORE_ERRORS_OPTION)


def _count(options: dict[str, object], name: str) -> int:
    value = options.get(name, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class Redelivery:
    """Enqueues delayed copies of a delivery."""

    def after_lease(self, broker: Broker, message: MessageProxy, retry_after: float) -> int:
        """Enqueue ``message`` again, ``retry_after`` seconds from now (the remaining lease of
        the owner processing it). Returns the delay in milliseconds."""
        delay = max(1, math.ceil(retry_after * 1000))
        self._enqueue(broker, message, delay, {DEFERRED_OPTION: deferrals(message.options) + 1})
        return delay

    def after_store_error(self, broker: Broker, message: MessageProxy, backoff: float) -> int:
        """Enqueue ``message`` again ``backoff`` seconds from now (the guard's back-off,
        :class:`taskonce.outage.Backoff`), counting the store error on the copy. Returns the
        delay in milliseconds."""
        delay = max(1, math.ceil(backoff * 1000))
        errors = store_errors(message.options)
        self._enqueue(broker, message, delay, {STORE_ERRORS_OPTION: errors + 1})
        return delay

    @staticmethod
    def _enqueue(
        broker: Broker, message: MessageProxy, delay: int, options: dict[str, int]
    ) -> None:
        # Message.copy gives the copy its own options dict: later changes to this delivery's
        # options (see results.keep_first_result) do not reach it. The broker assigns the
        # copy's eta (and, on Redis, a new redis_message_id); message_id stays the same.
        copy = message.copy(queue_name=q_name(message.queue_name), options=options)
        for counter in (STORE_ERRORS_OPTION, DEFERRED_OPTION):
            if counter not in options:  # each counts consecutive redeliveries of its kind
                copy.options.pop(counter, None)
        with send_now():  # the same message again, never a deferred send of another handler
            broker.enqueue(copy, delay=delay)
