"""The hand-off of a run that replaces itself (:mod:`taskonce.replace`), on the memory store:
its sends recorded apart, the claim released, the sends published after the replacement or
withdrawn; a replacement's sends under ids of their own."""

from __future__ import annotations

import pytest

import taskonce
from taskonce import handoff, replace
from taskonce.handoff import derive_id, id_base
from taskonce.stores.base import MAX_KEY_LENGTH, Status
from taskonce.ticket import Decision, Delivery
from tests.test_handoff import make_guard


def begin(guard: taskonce.Guard, replaced: int = 0, message_id: str = "m-1") -> taskonce.Ticket:
    ticket = guard.begin(Delivery(message_id, "jobs", task="t", replaced=replaced))
    assert ticket.decision is Decision.RUN
    return ticket


def send_two(ticket: taskonce.Ticket) -> list[str]:
    capture = handoff.current()
    assert capture is not None and capture is ticket.capture
    return [capture.add("python", {"task": "child", "args": [i]}) for i in range(2)]


def test_hand_over_records_apart_releases_the_claim_and_dispatch_publishes() -> None:
    guard, events, broker = make_guard(taskonce.open_store("memory://"))
    ticket = begin(guard)
    ids = send_two(ticket)
    assert ids == [derive_id("jobs:m-1", i) for i in range(2)]

    handover = replace.hand_over(guard, ticket)
    assert handover is not None and handover.token
    assert handoff.current() is None  # the capture ended
    assert guard.store.get("jobs:m-1") is None  # the claim released: the replacement claims
    assert guard.store.due_for_relay().sends == [replace.record_key("jobs:m-1")]
    assert broker.sent == []  # nothing before the replacement is out

    replacement = begin(guard, replaced=1)  # the replacement: same id, same key, claims it
    assert replacement.key == "jobs:m-1"
    replace.dispatch(guard, handover)
    assert [s.id for s in broker.sent] == ids
    assert guard.store.due_for_relay().sends == []
    theirs = send_two(replacement)
    assert theirs == [derive_id(id_base("jobs:m-1", 1), i) for i in range(2)]
    assert not set(theirs) & set(ids)
    guard.finish(replacement, None)
    assert len(broker.sent) == 4
    assert events.count("sends_deferred") == [2, 2]
    assert events.count("sends_dispatched") == [2, 2]
    assert "released" in events.names()


def test_withdraw_when_the_replacement_was_not_published() -> None:
    guard, events, broker = make_guard(taskonce.open_store("memory://"))
    ticket = begin(guard)
    send_two(ticket)
    handover = replace.hand_over(guard, ticket)
    assert handover is not None

    replace.withdraw(guard, handover)
    assert guard.store.due_for_relay().sends == []
    assert guard.relay(older_than=0) == 0
    assert broker.sent == []
    assert events.count("sends_discarded") == [2]


def test_a_rerun_that_replaces_again_finds_the_record_and_publishes_it_once() -> None:
    """The worker died after the record, before the replacement: the message runs again,
    sends the same messages (same ids) and replaces again; the first record stands."""
    guard, events, broker = make_guard(taskonce.open_store("memory://"))
    guard.recorder_lease = 0.0  # the dead recorder's lease has run out by the re-run
    first = begin(guard)
    ids = send_two(first)
    assert replace.hand_over(guard, first) is not None  # ...and the worker dies here

    again = begin(guard)
    assert send_two(again) == ids
    handover = replace.hand_over(guard, again)
    assert handover is not None and handover.stood and not handover.token
    record = guard.store.get(handover.key)
    assert record is not None and record.status is Status.COMPLETED
    replace.dispatch(guard, handover)
    assert sorted(s.id for s in broker.sent) == sorted(ids)
    assert events.count("sends_discarded") == [2]  # the re-run's copies: the record stands
    assert events.count("sends_redispatched") == [2]
    assert guard.relay(older_than=0) == 0
    assert len(broker.sent) == 2


def test_a_run_that_sent_nothing_is_just_released() -> None:
    guard, events, _ = make_guard(taskonce.open_store("memory://"))
    ticket = begin(guard)
    assert replace.hand_over(guard, ticket) is None
    assert guard.store.get("jobs:m-1") is None
    assert events.names()[-1] == "released"


def test_record_keys() -> None:
    assert replace.record_key("q:1") == "replaced:0:q:1"
    assert replace.record_key("q:1", 2) == "replaced:2:q:1"
    long = replace.record_key("q:" + "x" * 250, 1)
    assert len(long) <= MAX_KEY_LENGTH and long.startswith("replaced:1:sha256:")
    assert id_base("q:1") == "q:1" and id_base("q:1", 1) != "q:1"


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_ids_are_stable_per_depth(depth: int) -> None:
    guard, _, _ = make_guard(taskonce.open_store("memory://"))
    ticket = begin(guard, replaced=depth)
    ids = send_two(ticket)
    guard.fail(ticket)
    again = begin(guard, replaced=depth)
    assert send_two(again) == ids
    guard.fail(again)


def test_a_late_copy_of_the_replaced_message_is_a_duplicate_not_a_payload_mismatch() -> None:
    """The replacement (another task, other arguments, the same id) records the key without a
    fingerprint: the replaced message coming back later (its worker died after the replace)
    is skipped, not dead-lettered as a payload mismatch."""
    guard, events, _ = make_guard(taskonce.open_store("memory://"))
    first = guard.begin(Delivery("m-1", "jobs", task="t"), (1,))
    assert first.decision is Decision.RUN
    guard.store.release("jobs:m-1", None)  # the replace released the claim
    handoff.end_capture(first)
    replacement = Delivery("m-1", "jobs", task="other", replaced=1)
    assert guard.execute(replacement, lambda x: x, ("z",)).status == "ran"
    late = guard.execute(Delivery("m-1", "jobs", task="t"), lambda x: x, (1,))
    assert late.status == "skipped"
    assert "payload_mismatch" not in events.names()
