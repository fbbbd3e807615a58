"""An app on the pickle serializer through a real Celery prefork worker (Redis broker and
store): a task whose argument is an object only pickle carries runs once, a duplicate is
skipped, the same id with another object is refused as a payload mismatch (the fingerprint of a
body without a canonical form is the body as delivered), and the same object sent from a
guarded body (the hand-off stores the pickled message as the producer made it) arrives once.

Pickle runs whatever code a message names: use it only with producers and a broker you trust
(Celery's own warning).
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest

from tests.celery.conftest import Stack, Table, start_stack, stop_stack
from tests.celery.test_serializers import labels_ran_once
from tests.helpers import wait_for
from tests.typed_values import OTHER_WHEN, PARCEL, VALUES, WHEN

PICKLE = {
    "task_serializer": "pickle",
    "result_serializer": "pickle",
    "accept_content": ["pickle", "json"],
    "result_accept_content": ["pickle", "json"],
}


@pytest.fixture(scope="module")
def pstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("celery-pickle")
    # C_FORCE_ROOT: Celery refuses pickle in a worker running as root (this machine's CI)
    env = {"TO_SERIALIZER": "pickle", "C_FORCE_ROOT": "1"}
    running = start_stack(tmp, "redis", "redis", extra_env=env)
    running.app.conf.update(PICKLE)
    try:
        yield running
    finally:
        stop_stack(running)


def test_an_object_argument_runs_once_and_a_reused_id_is_refused(
    pstack: Stack, runs: Table
) -> None:
    task_id = str(uuid.uuid4())
    pstack.send("t.typed_obj", (runs.name, "parcel", PARCEL), "eager", task_id=task_id)
    labels_ran_once(runs, ["parcel"])

    pstack.send("t.typed_obj", (runs.name, "parcel", PARCEL), "eager", task_id=task_id)
    wait_for(lambda: pstack.count(task_id, "duplicate_skipped") >= 1, 30, what="the duplicate")
    other = dataclasses.replace(PARCEL, sent=OTHER_WHEN)
    pstack.send("t.typed_obj", (runs.name, "parcel", other), "eager", task_id=task_id)
    wait_for(lambda: pstack.count(task_id, "payload_mismatch") >= 1, 30, what="the mismatch")
    assert runs.count("parcel") == 1 and pstack.count(task_id, "claimed") == 1


def test_objects_sent_from_a_guarded_body_arrive_once(pstack: Stack, runs: Table) -> None:
    """The hand-off under pickle: an object, and the four values through a chain and a
    ``link`` callback, each sent from a guarded body and run once with its types."""
    pstack.send("t.typed_obj_sender", (runs.name, "obj-sender"), "eager")
    pstack.send("t.typed_sender", (runs.name, "body", ["delay", "chain", "link"]), "eager")
    typed_id = str(uuid.uuid4())
    pstack.send(
        "t.typed", (runs.name, "plain", *VALUES), "eager", task_id=typed_id, kwargs={"when": WHEN}
    )
    labels_ran_once(
        runs,
        [
            "obj-sender", "obj-sender-child", "plain", "body", "body/delay", "body/chain-1",
            "body/chain-2", "body/link-first", "body/link-callback",
        ],
    )  # fmt: skip
