"""Dramatiq with its ``PickleEncoder`` through a real worker (Redis broker and store): what the
broker's encoder carries, taskonce carries.

An actor whose arguments are a datetime, a Decimal, a UUID, bytes and an object only pickle
carries runs once, a duplicate is skipped, the same id with another datetime is refused as a
payload mismatch; the same values sent from a guarded actor (a send and a pipeline: the
hand-off stores the message as the encoder encoded it) each run once with their types (the
actor checks them itself, ``typed`` in tests/dramatiq/app.py). A send stored by taskonce before
it kept the encoded message is still published. Pickle runs whatever code a message names: use
it only with producers and a broker you trust.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import dramatiq
import pytest
import sqlalchemy as sa

from tests.dramatiq.conftest import REDIS_REDIS, Harness, harness_for
from tests.typed_values import OTHER_WHEN, PARCEL, VALUES


@pytest.fixture(scope="module")
def pickled(pg_engine: sa.Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    encoder = dramatiq.get_encoder()  # build() sets PickleEncoder process-wide
    tmp = tmp_path_factory.mktemp("dramatiq-pickle")
    try:
        with harness_for(REDIS_REDIS, tmp, pg_engine, "shared", encoder="pickle") as harness:
            yield harness
    finally:
        dramatiq.set_encoder(encoder)


@pytest.fixture
def table(pickled: Harness) -> Iterator[str]:
    name = pickled.new_runs_table()
    yield name
    pickled.drop_table(name)


@pytest.fixture
def children(pickled: Harness) -> Iterator[str]:
    name = pickled.new_runs_table()
    yield name
    pickled.drop_table(name)


def test_pickled_arguments_run_once_and_a_reused_id_is_refused(
    pickled: Harness, table: str
) -> None:
    h = pickled
    message = h.send("typed", table, "direct", *VALUES, PARCEL)
    h.wait(lambda: h.runs(table) == 1, 60, "the typed run")

    h.enqueue(message)
    h.wait(lambda: "duplicate_skipped" in h.event_names(message.message_id), 30, "the duplicate")
    h.enqueue(message.copy(args=(table, "direct", OTHER_WHEN, *VALUES[1:], PARCEL)))
    h.wait(lambda: "payload_mismatch" in h.event_names(message.message_id), 30, "the mismatch")
    assert h.runs(table) == 1
    assert h.event_names(message.message_id).count("claimed") == 1
    assert "cannot be fingerprinted" not in h.workers[0].output()


def test_pickled_sends_from_a_guarded_actor_arrive_once(
    pickled: Harness, table: str, children: str
) -> None:
    h = pickled
    parent = h.send("typed_sender", table, children)
    h.wait(lambda: h.runs(children) >= 3, 60, "the sent and piped children")
    h.wait(lambda: "sends_dispatched" in h.event_names(parent.message_id), 30, "the dispatch")
    assert h.runs(table) == 1 and h.runs(children) == 3
    rows = h.run_rows(children)
    assert len({row["message_id"] for row in rows}) == 3  # three messages, each once


#: A hand-off send as taskonce 0.x stored it (printed by that version's capture of
#: ``old_child.send("TABLE", "LABEL")``): the message's fields as JSON.
OLD_DRAMATIQ_SEND = (
    '{"id":"be35ffde-b460-58b4-8c26-40c20dc0c9da","framework":"dramatiq","body":{"queue_name":'
    '"QUEUE","actor_name":"old_child","args":["TABLE","LABEL"],"kwargs":{},"options":{},'
    '"message_timestamp":1795920048788,"delay":null}}'
)


def test_a_send_stored_in_the_old_format_is_published_after_an_upgrade(
    pickled: Harness, table: str
) -> None:
    h = pickled
    data = json.loads(OLD_DRAMATIQ_SEND)
    data["id"] = child_id = str(uuid.uuid4())
    queue = h.config.queue("main")
    data["body"].update(queue_name=queue, actor_name="child", args=[table, "old"])
    store = h.app.guard.store
    store.mark(f"{queue}:{uuid.uuid4()}", 3600, None, None, sends=(json.dumps(data),), token="t")
    h.wait(lambda: h.app.guard.relay(older_than=0) >= 0 and h.runs(table) == 1, 60, "the send")
    h.wait(lambda: "completed" in h.event_names(child_id), 30, "the child's record")
    assert h.runs(table, child_id) == 1
