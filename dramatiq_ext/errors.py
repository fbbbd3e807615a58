"""The exceptions the Dramatiq middleware raises inside Dramatiq's hooks.

Dramatiq's ``emit_before`` logs and *swallows* any exception from a ``before_*`` hook that is not
a :class:`dramatiq.middleware.MiddlewareError`, and then runs the actor anyway. Every exception
this package raises from a hook is therefore a ``MiddlewareError``; the ones that mean "do not
run this delivery" derive from :class:`dramatiq.middleware.SkipMessage`, so the worker takes
its skip path (no ``on_failure`` callback, no retry counted, acknowledged or — when the message
was failed first — dead-lettered).
"""

from __future__ import annotations

from dramatiq.middleware import MiddlewareError, SkipMessage

from taskonce.errors import ConfigError, TaskonceError


class IdempotencyConfigError(MiddlewareError, ConfigError):
    """The middleware's setup is wrong: a bad ``idempotency=`` actor option, the middleware in
    the wrong place relative to ``Retries``, or added twice. Raised while actors are declared
    or when the worker boots, so a misconfigured worker never consumes a message."""


class MiddlewareOrderError(IdempotencyConfigError):
    """``IdempotencyMiddleware`` must come after ``Retries`` in ``broker.middleware``: Dramatiq
    runs ``after_*`` hooks in reverse order, and the claim must be released before ``Retries``
    enqueues the retry."""


class NotRun(SkipMessage):
    """Base class of the skip reasons: the guard decided this delivery's actor does not run."""


class DuplicateSkipped(NotRun):
    """The key was already handled (``duplicate_skipped``): acknowledged without running."""


class InProgressDeferred(NotRun):
    """Another live owner holds the claim (``in_progress_deferred``): a copy of the message was
    enqueued again with a delay of the lease's remaining time, and this delivery is
    acknowledged."""


class StoreDown(NotRun):
    """The store could not be reached and the policy is ``fail_closed``: the actor did not run;
    a copy of the message was enqueued again with a backoff delay."""


class Rejected(NotRun):
    """The delivery can never be run safely (payload mismatch, no usable message id, a
    configuration error met at run time): the message was failed, so Dramatiq moves it to the
    dead-letter queue."""


class GuardError(MiddlewareError, TaskonceError):
    """The guard could not decide (an unexpected error, or the broker refused the re-enqueue of
    a deferred message). The actor is not run; the message takes Dramatiq's failure path
    (``Retries`` retries it)."""


__all__ = [
    "DuplicateSkipped",
    "GuardError",
    "IdempotencyConfigError",
    "InProgressDeferred",
    "MiddlewareOrderError",
    "NotRun",
    "Rejected",
    "StoreDown",
]
