"""Serializers and argument types through a real Celery prefork worker (Redis broker,
PostgreSQL store, kombu's JSON): what Celery carries, taskonce carries.

A task whose arguments are a datetime, a Decimal, a UUID and bytes runs once with those types,
and a duplicate is skipped; the same id with another datetime is refused as a payload
mismatch. The same values travel through every canvas shape — sent from a guarded body (the
hand-off), from the test process, through ``self.replace()`` and ``send_on_commit`` — and each
task runs once with its types (it checks them itself: ``tests/celery/typed_tasks.py``). A send
stored by taskonce before it kept the encoded message (JSON arguments and options) is still
published. The pickle serializer: ``test_serializers_pickle.py``.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import taskonce
from taskonce.celery_ext import setup
from taskonce.stores.transactional import TransactionalStore
from tests.celery.conftest import Stack, Table, start_stack, stop_stack
from tests.celery.typed_tasks import SHAPES, send_shape, typed_sig
from tests.helpers import POSTGRES_URL, wait_for
from tests.typed_values import OTHER_WHEN, VALUES, WHEN


@pytest.fixture(scope="module")
def jstack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("celery-serializers")
    running = start_stack(tmp, "redis", "postgresql", extra_env={"TO_RELAY_EVERY": "2"})
    try:
        yield running
    finally:
        stop_stack(running)


@pytest.fixture(scope="module")
def guard(jstack: Stack) -> Iterator[taskonce.Guard]:
    """A guard on the worker's store in the test process, publishing through the test's app:
    for ``send_on_commit`` and the relay of sends stored in the old format."""
    store = taskonce.open_store(jstack.store_url, table=jstack.store_ns)
    made = taskonce.Guard(store)
    setup(jstack.app, made)
    try:
        yield made
    finally:
        made.close()


def labels_ran_once(runs: Table, labels: list[str], timeout: float = 90) -> None:
    """Wait until each label ran, then check each ran once and no task saw wrong types."""
    wait_for(
        lambda: all(runs.count(label) >= 1 for label in labels) or wrong(runs),
        timeout=timeout,
        interval=0.2,
        what=f"runs of {labels}",
    )
    assert wrong(runs) == []
    assert {label: runs.count(label) for label in labels} == dict.fromkeys(labels, 1)


def wrong(runs: Table) -> list[str]:
    return [row[1] for row in runs.rows() if str(row[1]).endswith(":wrong-types")]


def test_typed_arguments_run_once_and_a_reused_id_is_refused(jstack: Stack, runs: Table) -> None:
    """datetime, Decimal, UUID and bytes arrive as themselves (the old code refused the task
    unrun); the same message again is skipped; the same id with another datetime is refused as
    ``payload_mismatch`` and not run."""
    task_id = str(uuid.uuid4())
    args = (runs.name, "direct", *VALUES)
    jstack.send("t.typed", args, "eager", task_id=task_id, kwargs={"when": WHEN})
    labels_ran_once(runs, ["direct"])

    jstack.send("t.typed", args, "eager", task_id=task_id, kwargs={"when": WHEN})
    wait_for(lambda: jstack.count(task_id, "duplicate_skipped") >= 1, 30, what="the duplicate")
    jstack.send("t.typed", args, "eager", task_id=task_id, kwargs={"when": OTHER_WHEN})
    wait_for(lambda: jstack.count(task_id, "payload_mismatch") >= 1, 30, what="the mismatch")
    assert runs.count("direct") == 1
    assert jstack.count(task_id, "claimed") == 1


def test_every_canvas_shape_carries_the_types(
    jstack: Stack, runs: Table, guard: taskonce.Guard
) -> None:
    """Each shape of ``SHAPES`` sent from a guarded body (captured, recorded, published after
    it) and from the test process; ``self.replace()`` with a typed signature; a
    ``send_on_commit`` block: every typed task runs once with its types, the chord body whose
    header failed never."""
    app = jstack.app
    body_id = str(uuid.uuid4())
    app.send_task(
        "t.typed_sender", args=(runs.name, "body", list(SHAPES)), task_id=body_id,
        queue=jstack.q("eager"),
    )  # fmt: skip
    for shape in SHAPES:
        send_shape(app, runs.name, "direct/", shape)
    app.send_task("t.typed_replacer", args=(runs.name, "replacer"), queue=jstack.q("eager"))
    engine = sa.create_engine(POSTGRES_URL)
    try:
        with Session(engine) as session, taskonce.send_on_commit(session, guard=guard):
            typed_sig(app, runs.name, "on-commit").apply_async()
            session.commit()
    finally:
        engine.dispose()

    labels = ["body", "replacer", "replacer-replaced", "on-commit"]
    for prefix in ("body/", "direct/"):
        labels += [f"{prefix}{label}" for labels_ in SHAPES.values() for label in labels_]
    labels_ran_once(runs, labels, timeout=120)
    assert runs.count("body/chord_errback-never") == runs.count("direct/chord_errback-never") == 0
    assert jstack.count(body_id, "sends_dispatched") == 1


#: A hand-off send as taskonce 0.x stored it (printed by that version's capture of
#: ``send_task("t.typed", args=("TABLE", "LABEL", *VALUES), kwargs={"when": WHEN},
#: queue="QUEUE")``): the arguments in kombu's JSON type tags, the publish options as JSON.
OLD_CELERY_SEND = (
    '{"id":"be35ffde-b460-58b4-8c26-40c20dc0c9da","framework":"celery","body":{"task":'
    '"t.typed","args":["TABLE","LABEL",{"__type__":"datetime","__value__":'
    '"2026-01-31T12:30:15.250000+00:00"},{"__type__":"decimal","__value__":"1234.5600"},'
    '{"__type__":"uuid","__value__":{"hex":"9bd0fdf88c43485e8165473e5bdb792d"}},'
    '{"__type__":"base64","__value__":"AP8gdGFza29uY2Ug/g=="}],"kwargs":{"when":'
    '{"__type__":"datetime","__value__":"2026-01-31T12:30:15.250000+00:00"}},"options":'
    '{"queue":"QUEUE"}}}'
)


def old_send(runs: Table, label: str, queue: str) -> str:
    data = json.loads(OLD_CELERY_SEND)
    data["id"] = str(uuid.uuid4())
    data["body"]["args"][:2] = [runs.name, label]
    data["body"]["options"]["queue"] = queue
    return json.dumps(data, separators=(",", ":"))


def test_sends_stored_in_the_old_format_are_published_after_an_upgrade(
    jstack: Stack, runs: Table, guard: taskonce.Guard
) -> None:
    """A hand-off record and a producer-outbox row written by the previous version (before the
    upgrade, pending) are published by this one's relay, with their types."""
    store = guard.store
    queue = jstack.q("eager")
    key = f"{queue}:{uuid.uuid4()}"
    store.mark(key, 3600, None, None, sends=(old_send(runs, "old-handoff", queue),), token="t")
    assert isinstance(store, TransactionalStore)
    engine = sa.create_engine(POSTGRES_URL)
    try:
        with engine.begin() as connection:
            store.record_sends_in(
                connection, f"outbox:{uuid.uuid4().hex}", (old_send(runs, "old-outbox", queue),),
                secrets.token_hex(16), 3600, 0.0,
            )  # fmt: skip
    finally:
        engine.dispose()
    # this process's relay, or the worker's (every 2 s): whichever takes them first
    wait_for(lambda: guard.relay(older_than=0) >= 0 and not store.due_for_relay().sends, 30, 0.5)
    labels_ran_once(runs, ["old-handoff", "old-outbox"])


def test_django_send_on_commit_carries_the_types(jstack: Stack, runs: Table) -> None:
    """``taskonce.django_ext.send_on_commit()``: the send is a row in Django's transaction
    (the Django store on the test project's PostgreSQL database), published at the commit
    through a publisher app on the worker's broker; it runs once with its types."""
    from django.db import transaction

    from taskonce.django_ext import DjangoStore
    from taskonce.django_ext import send_on_commit as django_send_on_commit
    from tests.celery.conftest import publisher
    from tests.django_project import databases

    databases.ready(["default"])
    django_guard = taskonce.Guard(DjangoStore("default"))
    app = publisher(str(jstack.app.conf.broker_url), jstack.prefix)
    setup(app, django_guard)
    try:
        with transaction.atomic(), django_send_on_commit(guard=django_guard):
            typed_sig(app, runs.name, "django-on-commit").apply_async()
            assert runs.count("django-on-commit") == 0  # not before the commit
        labels_ran_once(runs, ["django-on-commit"])
    finally:
        app.close()
        django_guard.close()
