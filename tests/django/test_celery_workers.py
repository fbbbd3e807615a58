"""The test project's Celery tasks through a real ``celery -A tests.django_project.celery worker
-P prefork`` (two pool processes, Redis broker db 14, the store ``django://default`` on
PostgreSQL, transactional): each scenario ends with exactly one ``Payment`` for the order in
the project's tables.

One worker for the module; each test has its own order and message ids, on one of the three
queues of ``settings.TASKONCE``: the default policy (eager), ``-lazy`` (lazy, looks first) and
``-optimistic`` (lazy, ``check_first: False``). The tasks' bodies are plain ORM
(tests/django_project/shop/tasks.py); what a test makes a run do after its writes (block, fail
once, wait for the other copy) rides in the message's keyword arguments.
"""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from tests.django.conftest import (
    ProjectProcess,
    Run,
    celery_worker,
    new_order,
    order_paid,
    payments,
)
from tests.helpers import require_service, wait_for

BROKER = "redis://127.0.0.1:6379/14"
QUEUES = {"eager": "", "lazy": "lazy", "optimistic": "optimistic"}
#: What ends a delivery, by the queue's mode: the one run that counts, and the others.
WON = {"completed", "marked"}
LOST = {"duplicate_skipped", "concurrent_duplicate"}

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def run(django_project: str, tmp_path_factory: pytest.TempPathFactory) -> Run:
    require_service("redis")
    return Run(tmp_path_factory.mktemp("django-celery"), django_project)


@pytest.fixture(scope="module")
def worker(run: Run) -> Iterator[ProjectProcess]:
    started = celery_worker(run)
    try:
        yield started
    finally:
        started.stop()
        _delete_queues(run)


@pytest.fixture(scope="module")
def publisher(worker: ProjectProcess) -> Iterator[Celery]:
    app = Celery("django-tests-publisher", broker=BROKER, set_as_current=False)
    yield app
    app.close()


def _delete_queues(run: Run) -> None:
    import redis

    client = redis.Redis.from_url(BROKER)
    try:
        names = [
            *client.scan_iter(match=f"{run.queue}*"),
            *client.scan_iter(f"_kombu.*{run.queue}*"),
        ]
        if names:
            client.delete(*names)
    finally:
        client.close()


def publish(app: Celery, run: Run, mode: str, order: Any, task_id: str, **test: Any) -> None:
    """``shop.charge(order.pk, **test)`` with id ``task_id`` on the queue of ``mode``."""
    app.send_task(
        "shop.charge", args=(order.pk,), kwargs=test, queue=run.q(QUEUES[mode]), task_id=task_id
    )


def outcomes(run: Run, task_id: str) -> list[str]:
    return [name for name in run.names(task_id) if name in WON | LOST]


def settled(run: Run, task_id: str, deliveries: int, timeout: float = 30) -> list[str]:
    """Wait until ``deliveries`` deliveries of ``task_id`` ended (ran and recorded, or were
    told apart as duplicates); the names of its events."""
    wait_for(
        lambda: len(outcomes(run, task_id)) >= deliveries,
        timeout=timeout,
        what=f"{deliveries} deliveries of {task_id} to end: {run.names(task_id)}",
    )
    return run.names(task_id)


def one_payment(run: Run, order: Any, task_id: str) -> None:
    """Exactly one payment for the order, written by ``task_id``, and the order paid."""
    from tests.django_project.shop.models import Payment

    assert payments(order.ref) == 1
    assert list(Payment.objects.filter(order=order).values_list("message_id", flat=True)) == [
        task_id
    ]
    assert order_paid(order.ref)


def new_id() -> str:
    return str(uuid.uuid4())


@pytest.mark.parametrize("mode", list(QUEUES))
def test_duplicate_on_the_wire_charges_once(
    run: Run, publisher: Celery, worker: ProjectProcess, mode: str
) -> None:
    """The same message (same task id) published twice: one payment."""
    order, task_id = new_order(f"wire-{mode}"), new_id()
    publish(publisher, run, mode, order, task_id)
    publish(publisher, run, mode, order, task_id)

    names = settled(run, task_id, 2)
    one_payment(run, order, task_id)
    ended = outcomes(run, task_id)
    assert sum(name in WON for name in ended) == 1, names
    assert sum(name in LOST for name in ended) == 1, names
    events = run.events(task_id)
    assert {e["queue"] for e in events} == {run.q(QUEUES[mode])}
    assert {e["mode"] for e in events} == {"eager" if mode == "eager" else "lazy"}
    assert {e["framework"] for e in events} == {"celery"}


@pytest.mark.parametrize("mode", list(QUEUES))
def test_concurrent_duplicate_charges_once(
    run: Run, publisher: Celery, worker: ProjectProcess, mode: str
) -> None:
    """Two copies at once on the two pool processes. Eager: the second finds the claim, is
    deferred, comes back and is skipped. Lazy (looking first or not): both run and write their
    payment at the same moment (each waits for the other's writes); the second mark meets the
    first one's key and its transaction — payment included — rolls back (the run is then
    reported as the duplicate it was: ``duplicate_skipped``)."""
    order, task_id = new_order(f"both-{mode}"), new_id()
    test = {"sleep": 1.0} if mode == "eager" else {"meet": 5.0}
    publish(publisher, run, mode, order, task_id, **test)
    publish(publisher, run, mode, order, task_id, **test)

    names = settled(run, task_id, 2)
    one_payment(run, order, task_id)
    if mode == "eager":
        assert run.runs(task_id) == 1
        assert names.count("claimed") == 1 and names.count("completed") == 1, names
        assert names.count("in_progress_deferred") >= 1, names
        assert names.count("duplicate_skipped") == 1, names
    else:
        assert run.runs(task_id) == 2  # both made their writes; one transaction committed
        # the loser's run left nothing: it is told apart as the duplicate it is
        assert sorted(names) == ["duplicate_skipped", "marked"], names
        pids = {e["worker"] for e in run.events(task_id)}
        assert len(pids) == 2  # on the two pool processes


@pytest.mark.parametrize("mode", ["eager", "optimistic"])
def test_sigkill_mid_body_charges_once(
    run: Run, publisher: Celery, worker: ProjectProcess, mode: str
) -> None:
    """The pool process is SIGKILLed after the body wrote its payment (not committed: nobody
    sees it); Celery gives the message back (``reject_on_worker_lost``) and the redelivery
    charges once."""
    order, task_id = new_order(f"kill-{mode}"), new_id()
    publish(publisher, run, mode, order, task_id, hang=True)
    pid = run.hung_pid(task_id)
    assert payments(order.ref) == 0 and not order_paid(order.ref)  # written, uncommitted
    os.kill(pid, signal.SIGKILL)

    names = settled(run, task_id, 1, timeout=60)
    one_payment(run, order, task_id)
    assert run.runs(task_id) == 2
    if mode == "eager":
        assert names.count("claimed") == 1 and names.count("completed") == 1, names
        taken = run.events(task_id, "lease_taken_over")
        assert len(taken) == 1 and taken[0]["reason"] == "owner_dead", names
    else:
        assert names == ["marked"], names
    assert worker.alive()


@pytest.mark.parametrize("mode", list(QUEUES))
def test_failing_handler_leaves_no_row_and_the_retry_charges_once(
    run: Run, publisher: Celery, worker: ProjectProcess, mode: str
) -> None:
    """The first run raises after its writes (``autoretry_for``): they roll back, the claim is
    released (eager) or nothing is marked (lazy); the retry writes the one payment."""
    order, task_id = new_order(f"fail-{mode}"), new_id()
    publish(publisher, run, mode, order, task_id, fail=True)

    names = settled(run, task_id, 1)
    one_payment(run, order, task_id)
    assert run.runs(task_id) == 2
    if mode == "eager":
        assert names == ["claimed", "released", "claimed", "completed"], names
    else:
        assert names == ["marked"], names


def test_delay_on_commit_in_a_handler_is_sent_with_the_record(
    run: Run, publisher: Celery, worker: ProjectProcess
) -> None:
    """``charge.delay_on_commit(pk)`` in a guarded task (``shop.settle``) is captured like
    ``delay``: the failed first run's send is discarded (never published), the retry's is
    recorded with its completion and published after it; a duplicate of the settle message
    sends nothing more. One payment, by one charge."""
    from tests.django_project.shop.models import Payment

    order, settle_id = new_order("settle"), new_id()
    publisher.send_task(
        "shop.settle", args=(order.pk,), kwargs={"fail": True}, queue=run.q(), task_id=settle_id
    )
    wait_for(lambda: payments(order.ref) == 1, timeout=30, what="the charge's payment")
    child = Payment.objects.get(order=order).message_id
    assert child != settle_id
    settled(run, child, 1)
    wait_for(
        lambda: "sends_dispatched" in run.names(settle_id), what="the settle's sends dispatched"
    )
    names = run.names(settle_id)
    first, second = names[: names.index("released") + 1], names[names.index("released") + 1 :]
    assert first == ["claimed", "sends_discarded", "released"], names
    assert sorted(second) == ["claimed", "completed", "sends_deferred", "sends_dispatched"], names
    assert second.index("sends_deferred") < second.index("sends_dispatched"), names
    assert {e["count"] for e in run.events(settle_id) if e["event"].startswith("sends_")} == {1}

    publisher.send_task(
        "shop.settle", args=(order.pk,), kwargs={"fail": True}, queue=run.q(), task_id=settle_id
    )
    settled(run, settle_id, 2)
    assert run.count(settle_id, "duplicate_skipped") == 1
    assert run.names(child) == ["claimed", "completed"]
    one_payment(run, order, child)


def test_worker_log_has_no_errors(worker: ProjectProcess, run: Run) -> None:
    """Nothing above made the worker log a traceback it should not have (the failing runs'
    retries are logged as retries, the SIGKILLed pool processes as lost workers)."""
    log = worker.log()
    allowed = ("Declined", "WorkerLostError", "exited with 'signal 9 (SIGKILL)'")
    tracebacks = [
        block
        for block in log.split("Traceback (most recent call last):")[1:]
        if not any(word in block for word in allowed)
    ]
    assert tracebacks == [], "\n".join(tracebacks)[-4000:]
