"""``current_key()``: the key of the delivery whose handler is running.

The key identifies the message, not the attempt: every redelivery, retry, deferred copy and
take-over of one message has the same key (``queue:message id`` by default), so a handler can
hand it to an outside API as that API's idempotency key (docs/outside-apis.md).

Whoever runs a handler sets it around the call and resets it after: :meth:`Guard.execute`
(``guard.run``), the Celery task (around the body) and the Dramatiq middleware (from
``before_process_message`` to ``after_process_message``/``after_skip_message``, in the worker
thread; an ``async def`` actor starts with a copy of that thread's context).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar("taskonce_key", default=None)


def current_key() -> str | None:
    """The key of the delivery being handled, or ``None`` outside a guarded handler.

    Inside a handler run by a guard — a Celery ``IdempotentTask``, a Dramatiq actor behind
    ``IdempotencyMiddleware``, :meth:`taskonce.Guard.run` — this is the key the guard claims or
    marks for the message: the same on every redelivery, retry and take-over of that message,
    different for every other message. Pass it on as an outside API's idempotency key (an
    ``Idempotency-Key`` header) so a re-run after a crash asks the API for the same thing again
    instead of something new.

    ``None`` outside a handler and in one the guard does not cover (``enabled=False``,
    ``idempotency=False``, a plain task, the task function called directly). When the store
    is unreachable (or fails unexpectedly) and the policy says ``fail_open``, the handler runs
    unguarded but still gets the key the guard would have claimed.
    """
    return _KEY.get()


@contextlib.contextmanager
def handling(key: str | None) -> Iterator[None]:
    """Make ``key`` :func:`current_key` inside the block (a handler's run), restoring the
    previous value after it (a guarded handler may run another one inside)."""
    token = _KEY.set(key)
    try:
        yield
    finally:
        _KEY.reset(token)


def run_as(
    key: str | None, fn: Callable[..., T], args: Sequence[Any], kwargs: Mapping[str, Any]
) -> T:
    """``fn(*args, **kwargs)`` with ``key`` as :func:`current_key` (:meth:`Guard.execute`)."""
    with handling(key):
        return fn(*args, **kwargs)


def enter(key: str | None) -> None:
    """Make ``key`` :func:`current_key` until :func:`leave` (hooks around a handler that
    cannot wrap it: Dramatiq's ``before_*``/``after_*``, in one worker thread)."""
    _KEY.set(key)


def leave() -> None:
    """No key from now on (the end of the delivery :func:`enter` began)."""
    _KEY.set(None)


__all__ = ["current_key", "enter", "handling", "leave", "run_as"]
