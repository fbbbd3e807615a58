"""One back-off rule after a store error, computed in the core and carried in the action's
``delay``: the first ``first`` seconds, doubled for each store error in a row, at most ``cap``,
jittered in the upper half. Celery's ``taskonce_store_retry_delay`` is its ``first``; Dramatiq's
``store_error_min_backoff``/``store_error_max_backoff`` its ``first``/``cap``.

The real-worker proofs: ``tests/celery/test_redelivery.py`` (the delays grow on a worker whose
store is down) and ``tests/dramatiq/test_store_down.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from taskonce import Delivery, Guard, Policy
from taskonce.action import Do, after, before
from taskonce.errors import ConfigError, StoreUnavailable
from taskonce.outage import DEFAULT_BACKOFF, Backoff
from taskonce.stores import MemoryStore


def test_the_longest_wait_doubles_from_first_up_to_cap() -> None:
    assert [DEFAULT_BACKOFF.longest(n) for n in range(8)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert DEFAULT_BACKOFF.longest(10_000) == 60  # no overflow however long the outage
    rule = Backoff(first=0.5, cap=3)
    assert [rule.longest(n) for n in range(4)] == [0.5, 1, 2, 3]


def test_each_delay_is_drawn_in_the_upper_half() -> None:
    rule = Backoff(first=0.5, cap=8)
    for attempt in range(6):
        longest = rule.longest(attempt)
        delays = [rule.delay(attempt) for _ in range(200)]
        assert all(longest / 2 <= d <= longest for d in delays)
        assert len(set(delays)) > 1  # jittered: the copies of one outage spread out


@pytest.mark.parametrize(
    ("first", "cap", "words"),
    [
        (0, 60, "first=0 must be a positive number of seconds"),
        (-1, 60, "first=-1 must be a positive number of seconds"),
        (True, 60, "first=True must be a positive number of seconds"),
        ("1", 60, "first='1' must be a positive number of seconds"),
        (1, float("inf"), "cap=inf must be a positive number of seconds"),
        (5, 2, "cap=2 is less than first=5 seconds"),
    ],
)
def test_bad_bounds_are_refused_in_one_line(first: Any, cap: Any, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        Backoff(first, cap, name="setting x")
    assert str(info.value) == f"setting x: {words}"


class DownStore(MemoryStore):
    """A store that cannot be reached for a claim."""

    def claim(self, *args: Any, **kwargs: Any) -> Any:
        raise StoreUnavailable("store did not answer claim of key 'q:m1'")


@pytest.mark.parametrize("store_errors", [0, 1, 3, 12])
def test_a_delivery_backed_off_waits_longer_for_each_store_error_in_a_row(
    store_errors: int,
) -> None:
    rule = Backoff(first=0.2, cap=5)
    guard = Guard(DownStore())
    delivery = Delivery("m1", "q", store_errors=store_errors)
    action = before(guard, lambda: delivery, backoff=rule)
    assert action.do is Do.BACK_OFF and isinstance(action.error, StoreUnavailable)
    longest = rule.longest(store_errors)
    assert longest / 2 <= action.delay <= longest


def test_a_transactional_commit_the_store_failed_backs_off_by_the_same_rule() -> None:
    """After the handler ran: the commit failed on the store's account (rolled back)."""
    from unittest import mock

    from taskonce.action import Action

    guard = Guard(MemoryStore())
    ticket = guard.begin(Delivery("m1", "q", store_errors=2))
    ticket.policy = Policy(transactional=True)  # as a transactional run's ticket says
    rule = Backoff(first=1, cap=60)
    with mock.patch.object(guard, "finish", side_effect=StoreUnavailable("commit failed")):
        action: Action = after(guard, ticket, None, rule)
    assert action.do is Do.BACK_OFF and action.ran
    assert 2 <= action.delay <= 4


def test_celerys_setting_is_the_first_back_off() -> None:
    from celery import Celery

    from taskonce.celery_ext.config import AppState, worker_options

    assert AppState().backoff == Backoff(1.0, 60.0, "WorkerOptions.backoff_first")
    app = Celery("backoff", broker="memory://", set_as_current=False)
    app.conf.taskonce_store_retry_delay = 5
    assert (worker_options(app.conf).backoff.first, worker_options(app.conf).backoff.cap) == (5, 60)
    app.conf.taskonce_store_retry_delay = 90.0  # longer than the usual cap: a fixed 90 s
    rule = worker_options(app.conf).backoff
    assert (rule.first, rule.cap) == (90.0, 90.0)
    app.close()


def test_dramatiqs_bounds_are_the_same_rule_in_milliseconds() -> None:
    from taskonce.dramatiq_ext import IdempotencyMiddleware

    middleware = IdempotencyMiddleware(
        Guard(MemoryStore()), store_error_min_backoff=200, store_error_max_backoff=800
    )
    assert (middleware.options.backoff.first, middleware.options.backoff.cap) == (0.2, 0.8)
    default = IdempotencyMiddleware(Guard(MemoryStore()))
    assert (default.options.backoff.first, default.options.backoff.cap) == (1.0, 60.0)


def test_both_adapters_wait_the_actions_delay_and_nothing_else() -> None:
    """Whatever the rule draws is what Celery's countdown and Dramatiq's enqueue delay are."""
    import time
    from unittest import mock

    import dramatiq
    from celery import Celery
    from celery.exceptions import Ignore
    from dramatiq import Message
    from dramatiq.broker import MessageProxy
    from dramatiq.brokers.stub import StubBroker

    from taskonce.celery_ext import IdempotentTask, setup
    from taskonce.dramatiq_ext import IdempotencyMiddleware
    from taskonce.dramatiq_ext.errors import StoreDown

    drawn = 42.5
    app = Celery("backoff-adapters", broker="memory://", set_as_current=False)
    setup(app, Guard(DownStore()))

    @app.task(base=IdempotentTask, shared=False, name="charge")
    def charge() -> None:
        raise AssertionError("not run while the store is down")

    waits: list[tuple[float, int]] = []

    def deliver_later(self: Any, call: Any, delay: float, **counts: int) -> None:
        waits.append((delay, counts.get("store_errors", 0)))
        raise Ignore()

    with (
        mock.patch.object(Backoff, "delay", return_value=drawn),
        mock.patch.object(IdempotentTask, "_deliver_later", deliver_later),
    ):
        charge.push_request(
            id="t-1", is_eager=False, called_directly=False, delivery_info={"routing_key": "celery"}
        )
        try:
            with pytest.raises(Ignore):
                charge()
        finally:
            charge.pop_request()
    assert waits == [(drawn, 1)]
    app.close()

    broker = StubBroker()
    middleware = IdempotencyMiddleware(Guard(DownStore()))
    broker.add_middleware(middleware)
    pay = dramatiq.actor(lambda: None, broker=broker, actor_name="pay", queue_name="q")
    message = MessageProxy(
        Message(queue_name="q", actor_name=pay.actor_name, args=(), kwargs={}, options={})
    )
    before_ms = time.time() * 1000
    with mock.patch.object(Backoff, "delay", return_value=drawn), pytest.raises(StoreDown):
        middleware.before_process_message(broker, message)
    copy = broker.queues["q.DQ"].get_nowait()
    copy = Message.decode(copy) if isinstance(copy, bytes) else copy
    assert before_ms + drawn * 1000 <= copy.options["eta"] <= time.time() * 1000 + drawn * 1000
    broker.close()
