"""Receipts (taskonce.receipts): a published send whose receiver is guarded on the same store is
looked for, published again when lost, given up on after the tries. The logic on the memory
store with a fake clock; the same story on every store with short times at the end."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import taskonce
from taskonce import handoff, receipts
from taskonce.cli import main as cli_main
from taskonce.handoff import Receipt, Send, derive_id
from taskonce.stores import Store
from taskonce.stores.memory import MemoryStore
from tests.helpers import wait_for

KEEP = 86400.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Events:
    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    def emit(self, event: Any) -> None:
        self.seen.append(dict(event))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e["event"] == name]


class Broker:
    """A publisher whose messages the test decides the fate of: delivered (the receiver's guard
    runs them, writing its record) or lost (nothing happens)."""

    def __init__(self, receiver: taskonce.Guard | None = None, keep_for: float = KEEP) -> None:
        self.published: list[Send] = []
        self.lose = True
        self.failing = False
        self.receiver = receiver
        self.keep_for = keep_for
        self.after = 0.0

    def __call__(self, send: Send) -> Receipt | None:
        if self.failing:
            raise ConnectionError("broker down")
        self.published.append(send)
        if not self.lose and self.receiver is not None:
            self.receiver.run(send.id, "child", lambda: None)
        return Receipt(f"child:{send.id}", self.keep_for, self.after)

    def count(self, send_id: str) -> int:
        return sum(1 for s in self.published if s.id == send_id)


def setup(
    store: Store, within: float = 10.0, **policy: Any
) -> tuple[taskonce.Guard, Events, Broker]:
    events = Events()
    guard = taskonce.Guard(
        store,
        default=taskonce.Policy(confirm_within=within, keep_for=KEEP, **policy),
        events=[events],
        dispatch_lease=5,
    )
    broker = Broker(receiver=guard)
    guard.register_publisher("python", broker)
    return guard, events, broker


def send_one(guard: taskonce.Guard, message_id: str = "m1") -> str:
    def body() -> None:
        capture = handoff.current()
        assert capture is not None
        capture.add("python", {"task": "child"})

    assert guard.run(message_id, "q", body).status == "ran"
    return derive_id(f"q:{message_id}", 0)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def memory(clock: Clock) -> MemoryStore:
    return MemoryStore(clock)


def test_a_lost_send_is_published_again_under_its_id_after_confirm_within(
    memory: MemoryStore, clock: Clock
) -> None:
    guard, events, broker = setup(memory)
    child = send_one(guard)
    assert broker.count(child) == 1
    record = memory.get("q:m1")
    assert record is not None and record.receipts is not None and not record.sends_pending
    clock.now += 9.9
    assert guard.relay(older_than=0) == 0 and broker.count(child) == 1  # not due yet
    clock.now += 0.1
    broker.lose = False  # the re-sent copy arrives
    assert guard.relay(older_than=0) == 1
    assert broker.count(child) == 2
    assert memory.get(f"child:{child}") is not None
    (event,) = events.named("sends_redispatched")
    assert event["reason"] == "unconfirmed" and event["count"] == 1 and event["key"] == "q:m1"
    clock.now += 20  # the next look finds the receipt: done, never published again
    assert guard.relay(older_than=0) == 0
    record = memory.get("q:m1")
    assert record is not None and record.receipts is None
    assert memory.stats()["receipts_awaited"] == 0
    clock.now += 1000
    guard.relay(older_than=0)
    assert broker.count(child) == 2 and not events.named("send_unconfirmed")


def test_a_send_that_arrived_is_never_published_again(memory: MemoryStore, clock: Clock) -> None:
    guard, events, broker = setup(memory)
    broker.lose = False
    child = send_one(guard)
    assert memory.stats()["receipts_awaited"] == 1
    clock.now += 10
    assert guard.relay(older_than=0) == 0
    assert broker.count(child) == 1
    assert memory.stats()["receipts_awaited"] == 0
    assert not events.named("sends_redispatched")
    assert not [e for e in events.named("duplicate_skipped") if e["queue"] == "child"]


def test_a_countdown_send_is_not_published_again_before_its_eta(
    memory: MemoryStore, clock: Clock
) -> None:
    guard, _, broker = setup(memory)
    broker.after = 60.0  # the send's ETA is a minute after its publish
    child = send_one(guard)
    clock.now += 69.9
    guard.relay(older_than=0)
    assert broker.count(child) == 1
    clock.now += 0.1
    guard.relay(older_than=0)
    assert broker.count(child) == 2


def test_after_three_tries_the_send_is_reported_once_and_left_alone(
    memory: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture, capsys: Any
) -> None:
    guard, events, broker = setup(memory)
    child = send_one(guard)
    for wait in (10, 20, 40):  # the looks after the publish and each re-send: 1, 2, 4 x 10 s
        clock.now += wait - 0.01
        guard.relay(older_than=0)
        clock.now += 0.01
        before = broker.count(child)
        guard.relay(older_than=0)
        assert broker.count(child) == before + 1
    assert broker.count(child) == 4  # 1 + TRIES
    clock.now += 80
    with caplog.at_level(logging.WARNING, logger="taskonce"):
        assert guard.relay(older_than=0) == 0
    (event,) = events.named("send_unconfirmed")
    assert event["message_id"] == child and event["task"] == "child" and event["count"] == 1
    assert event["key"] == "q:m1"  # the sender's record, where taskonce inspect shows it
    assert "published 3 more times and never received" in caplog.text
    for _ in range(5):
        clock.now += 10_000
        guard.relay(older_than=0)
    assert broker.count(child) == 4 and len(events.named("send_unconfirmed")) == 1
    assert memory.stats()["receipts_awaited"] == 0
    record = memory.get("q:m1")
    assert record is not None
    data, lines = receipts.described(record.receipts)
    assert data == [
        {
            "id": child,
            "framework": "python",
            "name": "child",
            "receiver_key": f"child:{child}",
            "tries": 3,
            "unconfirmed": True,
        }
    ]
    assert lines == [f"unconfirmed send {child} python child -> child:{child} (re-sent 3 times)"]


def test_a_broker_down_at_a_resend_does_not_count_as_a_try(
    memory: MemoryStore, clock: Clock
) -> None:
    guard, _, broker = setup(memory)
    child = send_one(guard)
    clock.now += 10
    broker.failing = True
    assert guard.relay(older_than=0) == 0
    broker.failing = False
    clock.now += receipts.RETRY_PUBLISH
    assert guard.relay(older_than=0) == 1
    assert broker.count(child) == 2
    (entry,) = receipts.decode(memory.get("q:m1").receipts or "")  # type: ignore[union-attr]
    assert entry.tries == 1


@pytest.mark.parametrize(
    ("within", "receipt"),
    [
        (0, Receipt("child:x", KEEP)),  # receipts off for the sender
        (10, None),  # a receiver taskonce cannot see
    ],
)
def test_nothing_is_awaited_without_receipts_or_a_visible_receiver(
    memory: MemoryStore, clock: Clock, within: float, receipt: Receipt | None
) -> None:
    guard, _, _ = setup(memory, within=within)
    published: list[Send] = []

    def publish(send: Send) -> Receipt | None:
        published.append(send)
        return receipt

    guard.register_publisher("python", publish)
    send_one(guard)
    record = memory.get("q:m1")
    assert record is not None and record.receipts is None and not record.sends_pending
    clock.now += 100_000
    guard.relay(older_than=0)
    assert len(published) == 1


def test_a_receiver_whose_records_expire_too_soon_is_not_awaited(
    memory: MemoryStore, clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    guard, _, broker = setup(memory)
    broker.keep_for = 299.0  # < 2 x 15 x 10 s: its record may be gone before the last look
    receipts._warned.clear()
    with caplog.at_level(logging.WARNING, logger="taskonce"):
        send_one(guard, "m1")
        send_one(guard, "m2")
    record = memory.get("q:m1")
    assert record is not None and record.receipts is None
    assert caplog.text.count("is not awaited") == 1  # once per receiving queue
    assert "keeps its records 299s, less than twice the 150s" in caplog.text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"confirm_within": 600, "keep_for": 3600},
            "Policy.confirm_within=600 does not fit keep_for=3600: a receipt is looked for up "
            "to 15 × confirm_within = 9000 s after the publish",
        ),
        ({"confirm_within": -1}, "Policy.confirm_within=-1 must be a number of seconds, 0 or"),
        ({"confirm_within": "5m"}, "Policy.confirm_within='5m' must be a number of seconds"),
        ({"confirm_within": True}, "Policy.confirm_within=True must be a number of seconds"),
    ],
)
def test_bad_confirm_within_is_a_config_error(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(taskonce.ConfigError) as error:
        taskonce.Policy(**fields)
    assert message in str(error.value)


def test_the_default_confirm_within_with_a_short_keep_for_is_not_an_error() -> None:
    policy = taskonce.Policy(keep_for=60)
    assert policy.confirm_within == 300
    assert taskonce.Policy(keep_for=60, confirm_within=0).confirm_within == 0
    assert taskonce.Policy(keep_for=3600, confirm_within=60).confirm_within == 60


class Counting:
    """Counts a store's calls by name."""

    def __init__(self, store: Store) -> None:
        self.calls: list[str] = []
        for name in ("due_for_relay", "take_sends", "take_receipts", "get"):
            setattr(store, name, self._wrap(name, getattr(store, name)))

    def _wrap(self, name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            return method(*args, **kwargs)

        return call


def test_a_sweep_with_nothing_due_is_one_store_call(memory: MemoryStore, clock: Clock) -> None:
    guard, _, broker = setup(memory)
    broker.lose = False
    for n in range(20):
        send_one(guard, f"m{n}")
    counting = Counting(memory)
    assert guard.relay(older_than=0) == 0
    assert counting.calls == ["due_for_relay"]


def test_inspect_and_stats_show_awaited_and_unconfirmed_sends(
    memory: MemoryStore, clock: Clock, capsys: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    guard, _, _ = setup(memory)
    child = send_one(guard)
    monkeypatch.setattr("taskonce.cli.store.open_store", lambda url: memory)
    monkeypatch.setattr(memory, "close", lambda: None)
    assert cli_main(["--store", "memory://", "inspect", "q:m1"]) == 0
    out = capsys.readouterr().out
    assert f"awaiting receipt {child} python child -> child:{child} (re-sent 0 times)" in out
    assert cli_main(["--store", "memory://", "--json", "inspect", "q:m1"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["receipts"][0]["receiver_key"] == f"child:{child}"
    assert cli_main(["--store", "memory://", "--json", "stats"]) == 0
    assert json.loads(capsys.readouterr().out)["receipts"] == 1


def test_prometheus_counts_unconfirmed_sends(memory: MemoryStore, clock: Clock) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    events = Events()
    guard = taskonce.Guard(
        memory,
        default=taskonce.Policy(confirm_within=10, keep_for=KEEP),
        events=[events, taskonce.PrometheusEvents(registry)],
    )
    guard.register_publisher("python", Broker(receiver=guard))
    send_one(guard)
    for _ in range(6):
        clock.now += 1000
        guard.relay(older_than=0)
    labels = {"event": "unconfirmed", "queue": "child", "task": "child", "framework": "python"}
    assert registry.get_sample_value("taskonce_sends_total", labels) == 1.0


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=200.0),  # seconds that pass
            st.booleans(),  # the broker fails the next publishes
            st.booleans(),  # the receiver's copy arrives now (if not yet)
        ),
        max_size=25,
    ),
    after=st.sampled_from([0.0, 5.0, 30.0]),
)
def test_no_send_is_published_more_than_one_plus_tries_times(
    steps: list[tuple[float, bool, bool]], after: float
) -> None:
    clock = Clock()
    store = MemoryStore(clock)
    guard, events, broker = setup(store)
    broker.after = after
    child = send_one(guard)
    arrived_at: float | None = None
    published_after_arrival = 0
    for wait, failing, arrive in steps:
        clock.now += wait
        broker.failing = failing
        if arrive and arrived_at is None:
            guard.run(child, "child", lambda: None)
            arrived_at = clock.now
        before = broker.count(child)
        guard.relay(older_than=0)
        if arrived_at is not None:
            published_after_arrival += broker.count(child) - before
    assert broker.count(child) <= 1 + receipts.TRIES
    assert published_after_arrival == 0  # a send that arrived is never published again
    unconfirmed = events.named("send_unconfirmed")
    assert len(unconfirmed) <= 1
    if unconfirmed:
        assert broker.count(child) == 1 + receipts.TRIES


@pytest.mark.parametrize(
    ("sender", "key"), [("q:m1", "q:m1"), ("outbox:5f0c", None)], ids=["task", "outbox"]
)
def test_send_unconfirmed_names_the_sending_tasks_record(sender: str, key: str | None) -> None:
    """``send_unconfirmed`` carries the sending task's key (the record ``taskonce inspect``
    shows the send in); a producer's outbox record is no delivery's key, so its event names
    none, as the outbox's other events."""

    class Sinks:
        def __init__(self) -> None:
            self.seen: list[dict[str, Any]] = []

        def send(self, event: Any) -> None:
            self.seen.append(dict(event))

    class Dispatcher:
        sinks = Sinks()

    send = Send("child-1", "python", {"task": "child"})
    entry = receipts.Entry(send.to_json(), "child:child-1", tries=receipts.TRIES)
    dispatcher: Any = Dispatcher()
    receipts._unconfirmed(dispatcher, sender, entry)
    (event,) = dispatcher.sinks.seen
    assert event["event"] == "send_unconfirmed" and event["key"] == key
    assert event["message_id"] == "child-1" and event["queue"] == "child"


def test_every_store_repairs_a_lost_send(store: Store) -> None:
    """The same story on every store, by its own clock: lost, re-sent after confirm_within,
    then received and left alone."""
    guard, events, broker = setup(store, within=0.2)
    # closed before the store fixture drops the store: its liveness thread would otherwise
    # go on writing to a store that is gone, and log the outage into later tests' output
    with guard:
        child = send_one(guard, "s1")
        assert broker.count(child) == 1
        broker.lose = False
        wait_for(lambda: guard.relay(older_than=0) == 1, timeout=10, what="the re-send")
        assert broker.count(child) == 2
        assert store.get(f"child:{child}") is not None
        wait_for(
            lambda: guard.relay(older_than=0) == 0 and store.stats()["receipts_awaited"] == 0,
            timeout=10,
            what="the receipt seen",
        )
        record = store.get("q:s1")
        assert record is not None and record.receipts is None
        assert broker.count(child) == 2
        assert [e["reason"] for e in events.named("sends_redispatched")] == ["unconfirmed"]


def test_a_failed_run_waiting_for_its_retry_is_not_taken_for_a_lost_message(
    memory: MemoryStore, clock: Clock
) -> None:
    """The child arrived, failed and released its claim for a retry due later than
    confirm_within: its failure left `<key>\\x1freceived`, so it is not sent again (each copy
    would start a retry chain of its own)."""
    guard, events, _ = setup(memory)
    child = send_one(guard)

    def fails() -> None:
        raise RuntimeError("try again in a minute")

    with pytest.raises(RuntimeError):
        guard.run(child, "child", fails)
    assert memory.get(f"child:{child}") is None  # released for the retry
    assert memory.get(f"child:{child}{receipts.RECEIVED_SUFFIX}") is not None
    clock.now += 10
    guard.relay(older_than=0)
    assert not events.named("sends_redispatched")
    assert memory.stats()["receipts_awaited"] == 0


def test_the_mark_of_a_failed_run_never_names_a_message(memory: MemoryStore) -> None:
    """The mark a failed run leaves is not the key of any message: a message whose id is
    ``<id>~received`` still runs after ``<id>`` failed (with the mark at ``<key>~received`` it
    was skipped as a duplicate), and no id can end with the mark's suffix."""

    def fails() -> None:
        raise RuntimeError("fails")

    for identity in ("id+queue", "id"):
        guard = taskonce.Guard(memory, default=taskonce.Policy(confirm_within=0, identity=identity))
        with pytest.raises(RuntimeError):
            guard.run(f"order-42-{identity}", "q", fails)
        ran: list[int] = []
        assert guard.run(f"order-42-{identity}~received", "q", ran.append, 1).status == "ran"
        assert ran == [1]
        with pytest.raises(taskonce.InvalidInput):
            guard.run(f"order-42-{identity}{receipts.RECEIVED_SUFFIX}", "q", ran.append, 2)
