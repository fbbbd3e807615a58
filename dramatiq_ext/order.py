"""Where the middleware must sit in ``broker.middleware``.

Dramatiq runs ``before_*`` hooks in list order and ``after_*`` hooks in *reverse* order. On a
failed run, this middleware's ``after_process_message`` releases the claim and ``Retries``'
``after_process_message`` enqueues the retry: the release must come first, or a fast retry
finds the key still claimed and is deferred for a whole lease. So the middleware must come
*after* ``Retries`` in the list — which ``broker.add_middleware(IdempotencyMiddleware(guard))``
(append) gives with Dramatiq's default middleware.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dramatiq.middleware import Retries

from taskonce.dramatiq_ext.errors import IdempotencyConfigError, MiddlewareOrderError

if TYPE_CHECKING:
    from dramatiq import Broker, Middleware


def check_order(broker: Broker, middleware: Middleware) -> None:
    """Raise :class:`MiddlewareOrderError` when ``middleware`` comes before a ``Retries`` in
    ``broker.middleware``, and :class:`IdempotencyConfigError` when a middleware of its type is
    there twice."""
    stack = broker.middleware
    mine = [i for i, m in enumerate(stack) if m is middleware]
    if not mine:
        return  # not (yet) on this broker
    twins = [m for m in stack if type(m) is type(middleware) and m is not middleware]
    if twins:
        raise IdempotencyConfigError(
            f"{type(middleware).__name__} was added to the broker {len(twins) + 1} times; add "
            "it once (every delivery would otherwise be claimed twice and deferred forever)"
        )
    retries = [i for i, m in enumerate(stack) if isinstance(m, Retries)]
    if retries and max(retries) > mine[0]:
        names = ", ".join(type(m).__name__ for m in stack)
        raise MiddlewareOrderError(
            f"{type(middleware).__name__} must come after Retries in broker.middleware (now: "
            f"{names}). Dramatiq runs after_* hooks in reverse order, so the claim must be "
            "released before Retries enqueues the retry. Add it with "
            "broker.add_middleware(IdempotencyMiddleware(guard)) — it appends — or "
            "broker.add_middleware(..., after=dramatiq.middleware.Retries)."
        )
