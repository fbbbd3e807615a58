"""The copies the middleware enqueues again (in process, StubBroker): a deferral counts itself
on the copy, so the guard can tell its own re-check from another duplicate."""

from __future__ import annotations

from dramatiq import Message
from dramatiq.broker import MessageProxy
from dramatiq.brokers.stub import StubBroker

from taskonce.dramatiq_ext.redelivery import (
    DEFERRED_OPTION,
    STORE_ERRORS_OPTION,
    Redelivery,
    deferrals,
    store_errors,
)


def test_each_deferral_counts_itself_on_the_copy_and_a_store_error_resets_it() -> None:
    broker = StubBroker()
    broker.declare_queue("q")
    redelivery = Redelivery()
    message = Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={})
    counts = []
    for _ in range(3):
        redelivery.after_lease(broker, MessageProxy(message), 0.25)
        message = broker.queues["q.DQ"].get_nowait()
        message = Message.decode(message) if isinstance(message, bytes) else message
        counts.append(deferrals(message.options))
    assert counts == [1, 2, 3]
    assert redelivery.after_store_error(broker, MessageProxy(message), 0.0123) == 13  # ms
    copy = broker.queues["q.DQ"].get_nowait()
    copy = Message.decode(copy) if isinstance(copy, bytes) else copy
    assert DEFERRED_OPTION not in copy.options and copy.options[STORE_ERRORS_OPTION] == 1
    assert store_errors(copy.options) == 1
    redelivery.after_store_error(broker, MessageProxy(copy), 0.01)
    again = broker.queues["q.DQ"].get_nowait()
    again = Message.decode(again) if isinstance(again, bytes) else again
    assert store_errors(again.options) == 2  # a store error in a row: counted on
    broker.close()


def test_a_count_that_is_no_positive_int_is_none() -> None:
    for value in (None, True, -1, "2", 1.5):
        assert deferrals({DEFERRED_OPTION: value}) == 0
        assert store_errors({STORE_ERRORS_OPTION: value}) == 0
    assert deferrals({}) == 0 and deferrals({DEFERRED_OPTION: 4}) == 4
